#!/usr/bin/env python
"""Time one linear layer per weight format (packed bf16, int8, int4) at the row counts of decoding (1) and of
verifying 8 / 16 drafts (9 / 17), formats interleaved, on the 1.5B target's MLP shapes.

    python scripts/kernels/bench_quant_kernels.py                         # wall clock, torch's thread count
    python scripts/kernels/bench_quant_kernels.py --threads 1 --cpu-time  # busy machine: CPU time of one thread

Each cell is the lower quartile of --reps calls (after one warm-up call) in ms; GB/s = weight bytes / time.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash2.kernels import PackedLinear
from dflash2.kernels.quant_linear import QuantLinear, quant_kernel_status


def layers(weight: torch.Tensor) -> dict[str, torch.nn.Module]:
    return {"bf16": PackedLinear.from_weight(weight), "int8": QuantLinear.from_weight(weight, weights="int8"),
            "int4": QuantLinear.from_weight(weight, weights="int4")}


def nbytes(layer) -> int:
    tensors = [layer.weight_data] + ([layer.scale_data] if isinstance(layer, QuantLinear) else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8960x1536,1536x8960", help="comma-separated NxK")
    ap.add_argument("--rows", default="1,2,4,9,17")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="thread CPU time instead of the wall clock")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"threads={torch.get_num_threads()} clock={clock.__name__} kernel: {quant_kernel_status()}")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(args.reps):
            t0 = clock()
            fn()
            samples.append(clock() - t0)
        return sorted(samples)[len(samples) // 4] * 1e3

    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            by_format = layers(torch.randn(n, k) * 0.02)
            xs = {m: torch.randn(m, k) for m in rows}
            cells = {(f, m): [] for f in by_format for m in rows}
            for _ in range(2):  # two interleaved passes; keep the better one per cell
                for m in rows:
                    for name, layer in by_format.items():
                        cells[(name, m)].append(timed(lambda: layer(xs[m])))
            for name, layer in by_format.items():
                gb = nbytes(layer) / 1e9
                row = " ".join(f"{m:>2} rows {min(cells[(name, m)]):6.2f} ms ({gb / min(cells[(name, m)]) * 1e3:4.1f} GB/s)"
                               for m in rows)
                print(f"{shape:>10} {name:>4}: {row}", flush=True)


if __name__ == "__main__":
    main()
