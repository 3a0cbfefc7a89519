#!/usr/bin/env python
"""What a shared machine gives right now: run it before and after a benchmark and report the numbers with it.

On a VM the cores, the memory bandwidth and (on Intel Xeons) the AMX tile unit are shared with neighbours, and the
same forward can cost 1.5-2x more in a busy phase (docs/kernels.md, Intel Xeon (AMX)). Three probes, each the best
of a few repeats, on --threads threads:

  compute  200 fp32 matmuls of 256^3 in cache (ms)
  stream   GB/s summing 1 GiB of fp32 (dflash2.bench.roofline.measure_read_bandwidth, the bandwidth `dflash2
           bench` puts its roofline at: what decoding is bound by)
  bf16     200 bf16 matmuls of 512^3 (ms and GFLOPS; oneDNN runs them on AMX tiles where the CPU has them: ~650-870
           GFLOPS on the Intel Xeon (AMX, model 207) when quiet, ~300-400 with a neighbour on the tile unit)

    python scripts/kernels/phase_probe.py
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash2.bench.roofline import best_seconds, measure_read_bandwidth


def best_ms(fn, repeats: int) -> float:
    return best_seconds(fn, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    compute = best_ms(lambda: [torch.mm(a, b) for _ in range(200)], args.repeats)
    stream = measure_read_bandwidth(1024, args.repeats)
    ab, bb = torch.randn(512, 512).bfloat16(), torch.randn(512, 512).bfloat16()
    bf16 = best_ms(lambda: [torch.mm(ab, bb) for _ in range(200)], args.repeats)
    print(f"{time.strftime('%H:%M:%S')} threads={args.threads}  compute {compute:.1f} ms  "
          f"stream {stream:.1f} GB/s  "
          f"bf16 {bf16:.1f} ms ({200 * 2 * 512**3 / bf16 / 1e6:.0f} GFLOPS)")


if __name__ == "__main__":
    main()
