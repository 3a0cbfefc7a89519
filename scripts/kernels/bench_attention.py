#!/usr/bin/env python
"""One layer's attention at Qwen2.5-Coder-1.5B's shapes (12 query / 2 KV heads, Dh 128, bf16): the row-invariant
kernel (dflash2.kernels.attention) against PyTorch's SDPA path (DFLASH2_ATTENTION=torch), for decoding (1 row) and
verification blocks (causal) over a cache of N slots, and a prefill. Best of --repeats calls (a shared machine's
slow calls are other jobs), in milliseconds per layer; multiply by 28 layers for a forward.

    python scripts/kernels/bench_attention.py                       # 1 thread
    python scripts/kernels/bench_attention.py --threads 2 --cached 200,1000,2000 --rows 1,3,7,9,17

With --variants, copies of attention.cpp (another arithmetic or schedule under test) are built as extensions of
their own and timed against the installed kernel, all of them called in turn in every round (a shared machine's
speed moves between rounds, not within one): CPU time of the process, median and best of --rounds, ms per
layer; --layers 28 cycles through 28 distinct caches per call, as a forward does, so that they do not stay in L3:

    python scripts/kernels/bench_attention.py --variants /tmp/a.cpp,/tmp/b.cpp --cached 200,8000 --rows 1,4,9 \
        --layers 1,28 --rounds 7
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dflash2.bench.roofline import best_seconds
from dflash2.kernels.attention import attention_kernel_status, invariant_attention
from dflash2.models.attention import torch_attend

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128


def best_ms(fn, repeats: int) -> float:
    fn()  # (a warm-up call)
    return best_seconds(fn, repeats) * 1e3


def build_variant(source: Path, tag: str, into: Path):
    """attention.cpp at ``source`` as the op ``torch.ops.dflash2_attention_<tag>.attention_rows``."""
    from torch.utils.cpp_extension import load

    from dflash2.kernels import attention, jit

    code = re.sub(r"TORCH_LIBRARY\(dflash2_attention,", f"TORCH_LIBRARY(dflash2_attention_{tag},", source.read_text())
    (into / tag).mkdir()
    copy = into / tag / f"attention_{tag}.cpp"
    copy.write_text(code)
    load(name=f"attention_{tag}", sources=[str(copy)], extra_cflags=attention._CFLAGS,
         extra_include_paths=[str(attention._SOURCE.parent)], extra_ldflags=jit.LDFLAGS, is_python_module=False,
         build_directory=str(into / tag))
    return getattr(torch.ops, f"dflash2_attention_{tag}").attention_rows


def cpu_ms(op, args, calls: int) -> float:
    """CPU time of the process per call of op on each (k, v) of args' caches, ms (per layer)."""
    q, caches, mask = args
    start = time.process_time()
    for _ in range(calls):
        for k, v in caches:
            op(q, k, v, mask, False, HEAD_DIM ** -0.5, 0)
    return (time.process_time() - start) / (calls * len(caches)) * 1e3


def compare_variants(ops: dict, cached: int, rows: int, layers: int, rounds: int, gen) -> str:
    """One case, every op in turn in every round (the order reversed every other round); a table row."""
    slots = cached + rows
    q = torch.randn(1, HEADS, rows, HEAD_DIM, generator=gen).to(torch.bfloat16)
    caches = [tuple(torch.randn(1, KV_HEADS, slots, HEAD_DIM, generator=gen).to(torch.bfloat16) for _ in range(2))
              for _ in range(layers)]
    mask = None if rows == 1 else torch.ones(1, rows, slots, dtype=torch.bool).tril(cached)
    calls = 1 if layers > 1 else max(1, int(4e6 / (slots * rows * HEADS * HEAD_DIM)))
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):  # (round 0: a warm-up)
        for name in (list(ops) if r % 2 else list(ops)[::-1]):
            ms = cpu_ms(ops[name], (q, caches, mask), calls)
            if r:
                times[name].append(ms)
    base = statistics.median(times["installed"])
    cells = [f"{statistics.median(t):.3f} / {min(t):.3f} ({statistics.median(t) / base:.2f})" for t in times.values()]
    return f"| {cached} | {rows} | {layers} | " + " | ".join(cells) + " |"


def run_variants(args) -> None:
    from dflash2.kernels import attention

    attention._ensure_loaded()
    ops = {"installed": attention._state["op"]}
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(args.variants.split(",")):
            ops[Path(path).stem] = build_variant(Path(path), f"v{i}", Path(tmp))
        print(f"threads={args.threads}, bf16, {HEADS}/{KV_HEADS} heads, Dh {HEAD_DIM}; CPU ms per layer, median / best"
              f" of {args.rounds} (ratio of medians to the installed kernel)")
        print("| cached | rows | layers | " + " | ".join(ops) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in ops) + " |")
        for layers in map(int, args.layers.split(",")):
            for cached in map(int, args.cached.split(",")):
                for rows in map(int, args.rows.split(",")):
                    print(compare_variants(ops, cached, rows, layers, args.rounds, gen), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,3,7,9,17")
    ap.add_argument("--cached", default="200,1000,2000")
    ap.add_argument("--prefill", type=int, default=1024, help="prompt length of the prefill row (0: none)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", default="", help="attention.cpp copies to time against the installed kernel")
    ap.add_argument("--layers", default="1", help="with --variants: distinct caches cycled per call (28: cold)")
    ap.add_argument("--rounds", type=int, default=7, help="with --variants: rounds of interleaved calls")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.variants:
        run_variants(args)
        return
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
