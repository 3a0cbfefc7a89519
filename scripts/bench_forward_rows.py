#!/usr/bin/env python
"""Time one target forward pass by the number of rows it verifies (1 = a decoding step), over a warm cache.

    python scripts/bench_forward_rows.py                        # default target, bf16, rows 1,3,5,7,9,13,17
    DFLASH2_DPBF16=off python scripts/bench_forward_rows.py     # the same without the AVX512-BF16 kernel

Prints the median of --reps passes per row count and its ratio to one row; the packed backend in use first.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash2.models.loading import load_transformer
from dflash2.models.store import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--rows", default="1,3,5,7,9,13,17")
    parser.add_argument("--cached", type=int, default=200, help="positions already in the KV cache")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    model = load_transformer(resolve_model(args.model, args.dtype), args.dtype, "cpu", weights=args.weights)
    backends = sorted({m.backend for m in model.modules() if hasattr(m, "backend")})
    print(f"{args.model} {args.dtype}/{args.weights}, backends {', '.join(backends)}, {torch.get_num_threads()} threads")
    rows = [int(r) for r in args.rows.split(",")]
    cache = model.new_cache(args.cached + max(rows) + 1)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, args.cached)), cache=cache, logits="last")
        base = None
        for m in rows:
            times = []
            for _ in range(args.reps + 1):
                start = time.perf_counter()
                model(torch.randint(0, 1000, (1, m)), cache=cache, logits="all")
                times.append(time.perf_counter() - start)
                cache.rollback(args.cached)
            ms = statistics.median(times[1:]) * 1e3
            base = base or ms
            print(f"rows {m:3d}: {ms:7.1f} ms  ({ms / base:.2f}x one row)", flush=True)


if __name__ == "__main__":
    main()
