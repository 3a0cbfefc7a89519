#!/usr/bin/env python
"""The one-call layer kernels (kernels/layer_ops.py) on and off, side by side: per weight format, one forward of
ROWS rows after a cached prompt (1 row = a plain decode step, more = a verification block), in interleaved rounds
(DFLASH2_LAYER_OPS=torch vs on, toggled between rounds in one process), medians of the rounds.

    python scripts/kernels/bench_layer_ops.py --weights gguf,bf16 --rows 1,4 --rounds 8 --json runs/layer-ops.json
    python scripts/kernels/bench_layer_ops.py --model qwen2.5-coder-0.5b-instruct --weights int8 --rows 1,8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

MODES = ("torch", "on")


def time_forward(model, rows: int, cached: int, passes: int) -> float:
    """ms per forward of ``rows`` rows after ``cached`` cached positions (median of ``passes``)."""
    cache = model.new_cache(cached + rows + 8)
    prompt = torch.arange(1000, 1000 + cached)[None]
    block = torch.arange(2000, 2000 + rows)[None]
    model(prompt, cache=cache, logits="none")
    times = []
    for _ in range(passes + 1):
        cache.rollback(cached)
        start = time.perf_counter()
        model(block, cache=cache, logits="all")
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--weights", default="gguf,bf16", help="comma-separated weight formats")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--cached", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--passes", type=int, default=8, help="timed forwards per round and setting")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import dflash2
    from dflash2.platform import reload_settings

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    with torch.inference_mode():
        for weights in args.weights.split(","):
            model = dflash2.load(args.model, weights=weights, dtype=args.dtype, drafter="none").target
            samples = {(mode, r): [] for mode in MODES for r in rows}
            for _ in range(args.rounds):
                for mode in MODES:
                    os.environ["DFLASH2_LAYER_OPS"] = mode
                    reload_settings()  # (parsed once per process otherwise)
                    for r in rows:
                        samples[mode, r].append(time_forward(model, r, args.cached, args.passes))
            os.environ.pop("DFLASH2_LAYER_OPS", None)
            reload_settings()
            for r in rows:
                off, on = (statistics.median(samples[m, r]) for m in MODES)
                results.append({"weights": weights, "rows": r, "torch_ms": off, "kernels_ms": on, "speedup": off / on,
                                "rounds": {m: samples[m, r] for m in MODES}})
                print(f"{args.model} {weights} {args.dtype} rows={r}: PyTorch ops {off:.1f} ms, layer kernels "
                      f"{on:.1f} ms ({off / on:.2f}x)", flush=True)
            del model
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "cached": args.cached,
                                         "threads": torch.get_num_threads(), "machine": platform.processor()
                                         or platform.machine(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
