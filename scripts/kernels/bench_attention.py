#!/usr/bin/env python
"""One layer's attention at Qwen2.5-Coder-1.5B's shapes (12 query / 2 KV heads, Dh 128, bf16): the row-invariant
kernel (dflash2.kernels.attention) against PyTorch's SDPA path (DFLASH2_ATTENTION=torch), for decoding (1 row) and
verification blocks (causal) over a cache of N slots, and a prefill. Best of --repeats calls (a shared machine's
slow calls are other jobs), in milliseconds per layer; multiply by 28 layers for a forward.

    python scripts/kernels/bench_attention.py                       # 1 thread
    python scripts/kernels/bench_attention.py --threads 2 --cached 200,1000,2000 --rows 1,3,7,9,17
"""

from __future__ import annotations

import argparse

import torch

from dflash2.bench.roofline import best_seconds
from dflash2.kernels.attention import attention_kernel_status, invariant_attention
from dflash2.models.attention import torch_attend

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def best_ms(fn, repeats: int) -> float:
    fn()  # (a warm-up call)
    return best_seconds(fn, repeats) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,3,7,9,17")
    ap.add_argument("--cached", default="200,1000,2000")
    ap.add_argument("--prefill", type=int, default=1024, help="prompt length of the prefill row (0: none)")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(attention_kernel_status())
    print(f"threads={args.threads}, bf16, {HEADS}/{KV_HEADS} heads, Dh {HEAD_DIM}; ms per layer (best of "
          f"{args.repeats})")
    print("cached | rows | kernel ms | torch ms | kernel/torch")
    gen = torch.Generator().manual_seed(0)
    cases = [(c, r) for c in map(int, args.cached.split(",")) for r in map(int, args.rows.split(","))]
    if args.prefill:
        cases.append((0, args.prefill))
    for cached, rows in cases:
        slots = cached + rows
        q = torch.randn(1, HEADS, rows, HEAD_DIM, generator=gen).to(torch.bfloat16)
        k = torch.randn(1, KV_HEADS, slots, HEAD_DIM, generator=gen).to(torch.bfloat16)
        v = torch.randn(1, KV_HEADS, slots, HEAD_DIM, generator=gen).to(torch.bfloat16)
        causal = cached == 0 and rows > 1  # a prefill: is_causal, as the decoder calls it
        mask = None if causal or rows == 1 else torch.ones(1, 1, rows, slots, dtype=torch.bool).tril(cached)
        ours = best_ms(lambda: invariant_attention(q, k, v, mask, causal), args.repeats)
        theirs = best_ms(lambda: torch_attend(q, k, v, mask, causal), args.repeats)
        print(f"{cached:6d} | {rows:4d} | {ours:9.3f} | {theirs:8.3f} | {ours / theirs:12.2f}")


if __name__ == "__main__":
    main()
