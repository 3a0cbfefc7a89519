"""What a load of the default target costs before its first token: imports and kernels, the load itself, the first
and second 30-row forwards, a one-row forward; wall and CPU time (CPU time stays meaningful on a shared machine).

    .venv/bin/python scripts/bench_load.py                           # the packed copy in the store (written if absent)
    DFLASH2_QUANT_CACHE=off .venv/bin/python scripts/bench_load.py   # read, fuse and pack the weights as before
"""

from __future__ import annotations

import time


def main() -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    from dflash2.kernels.prebuild import build_kernels
    from dflash2.models.loading import load_transformer
    from dflash2.models.store import DEFAULT_TARGET, resolve_model

    list(build_kernels())
    t1, c1 = time.perf_counter(), time.process_time()
    model = load_transformer(resolve_model(DEFAULT_TARGET, "bf16"), "bf16")
    t2, c2 = time.perf_counter(), time.process_time()
    ids = torch.arange(100, 130)[None]  # [1, 30]
    with torch.inference_mode():
        model(ids)
        t3, c3 = time.perf_counter(), time.process_time()
        model(ids)
        t4, c4 = time.perf_counter(), time.process_time()
        for _ in range(5):
            model(ids[:, :1])
        t5, c5 = time.perf_counter(), time.process_time()
    print(f"imports+kernels wall {t1 - t0:.2f} s cpu {c1 - c0:.2f} s | load wall {t2 - t1:.2f} s cpu {c2 - c1:.2f} s | "
          f"first 30-row forward wall {t3 - t2:.2f} s cpu {c3 - c2:.2f} s | second wall {t4 - t3:.2f} s cpu "
          f"{c4 - c3:.2f} s | 1-row forward wall {(t5 - t4) / 5 * 1000:.0f} ms cpu {(c5 - c4) / 5 * 1000:.0f} ms")


if __name__ == "__main__":
    main()
