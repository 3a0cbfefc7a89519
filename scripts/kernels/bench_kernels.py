#!/usr/bin/env python
"""Time CPU linear layers at LLM-decoding shapes: torch bf16 F.linear, torch fp32 F.linear and
dflash2's PackedLinear (bf16 packed weights, AVX2/FMA kernel).

    python scripts/kernels/bench_kernels.py                       # all shapes, M in 1..64
    python scripts/kernels/bench_kernels.py --shapes 8960x1536 --rows 1,8,16 --reps 5
    python scripts/kernels/bench_kernels.py --skip-fp32           # the fp32 copy of the lm head is 0.9 GB

Shapes are N x K (out x in features).  GB/s is the bf16 weight bytes (N*K*2) per call divided by
the time (fp32 F.linear is charged the same bytes, so the columns compare end-to-end speed).
Each time is the median of --reps calls after one warm-up call.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dflash2.kernels import PackedLinear, kernel_status, kernels_available

DEFAULT_SHAPES = "8960x1536,1536x8960,151936x1536"
DEFAULT_ROWS = "1,2,4,8,16,32,64"


def _time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated NxK")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help="comma-separated activation row counts M")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--skip-fp32", action="store_true", help="skip torch fp32 F.linear")
    ap.add_argument("--skip-bf16", action="store_true", help="skip torch bf16 F.linear")
    args = ap.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()}  kernel: {kernel_status()}")
    if not kernels_available():
        print("(PackedLinear runs its PyTorch fallback)")
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    header = (
        f"{'N x K':>14} {'M':>3} | {'bf16 ms':>8} {'GB/s':>5} | {'fp32 ms':>8} {'GB/s':>5} | "
        f"{'packed ms':>9} {'GB/s':>5} | {'x bf16':>6}"
    )
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.lower().split("x"))
            w16 = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            w32 = None if args.skip_fp32 else w16.float()
            layer = PackedLinear.from_weight(w16)
            gb = n * k * 2 / 1e9
            for m in rows:
                x = torch.randn(m, k)
                x16 = x.to(torch.bfloat16)
                t16 = None if args.skip_bf16 else _time(lambda: F.linear(x16, w16), args.reps)
                t32 = None if w32 is None else _time(lambda: F.linear(x, w32), args.reps)
                tp = _time(lambda: layer(x16), args.reps)

                def cell(t: float | None, width: int) -> str:
                    if t is None:
                        return f"{'-':>{width}} {'-':>5}"
                    return f"{t:>{width}.2f} {gb / (t / 1e3):>5.1f}"

                speed = f"{t16 / tp:>5.1f}x" if t16 else f"{'-':>6}"
                print(f"{shape:>14} {m:>3} | {cell(t16, 8)} | {cell(t32, 8)} | {cell(tp, 9)} | {speed}", flush=True)
            del w32, layer


if __name__ == "__main__":
    main()
