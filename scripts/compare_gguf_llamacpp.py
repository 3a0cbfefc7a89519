#!/usr/bin/env python
"""dflash2's ``--weights gguf`` against llama.cpp on the same GGUF file: logits over the bench prompts (max / mean
absolute difference, top-1 agreement per position) and greedy decoding (tokens shared before the first difference),
optionally plain decoding speed of both (same process, interleaved).

    python scripts/compare_gguf_llamacpp.py --model qwen-1.5b --per-suite 2 --tokens 32
    python scripts/compare_gguf_llamacpp.py --model qwen-0.5b --per-suite 2 --speed 32

Needs llama-cpp-python with its library (scripts/build_llama_cpp.sh; see dflash2/peers/llamacpp.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from dflash2.bench.datasets import load_suite
from dflash2.models.gguf_weights import gguf_file_of
from dflash2.models.loading import load_transformer
from dflash2.models.store import resolve_model
from dflash2.models.tokenizer import Tokenizer
from dflash2.peers.llamacpp import _import_llama_cpp


@torch.inference_mode()
def ours_logits(model, ids: list[int]) -> np.ndarray:
    out = model(torch.tensor([ids]), cache=model.new_cache(len(ids) + 1), logits="all").logits[0]
    return out.float().numpy()  # [T, V]


def llama_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32)  # [T, V]


@torch.inference_mode()
def ours_greedy(model, ids: list[int], tokens: int) -> tuple[list[int], float]:
    cache = model.new_cache(len(ids) + tokens + 1)
    token = model(torch.tensor([ids]), cache=cache, logits="last").logits[0, -1].argmax()
    out, t0 = [int(token)], time.perf_counter()
    for _ in range(tokens - 1):
        token = model(token.view(1, 1), cache=cache, logits="last").logits[0, -1].argmax()
        out.append(int(token))
    return out, (tokens - 1) / (time.perf_counter() - t0)


def llama_greedy(llm, ids: list[int], tokens: int) -> tuple[list[int], float]:
    llm.reset()
    llm.eval(ids)
    token = int(np.argmax(llm.scores[len(ids) - 1]))
    out, t0 = [token], time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([token])
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(token)
    return out, (tokens - 1) / (time.perf_counter() - t0)


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen-1.5b")
    ap.add_argument("--per-suite", type=int, default=2, help="prompts per suite (humaneval, gsm8k, mt_bench)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--max-prompt", type=int, default=256, help="prompt tokens kept (the first ones)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, "bf16")
    model = load_transformer(model_dir, "bf16", weights="gguf")
    tokenizer = Tokenizer(model_dir)
    llama_cpp = _import_llama_cpp()
    llm = llama_cpp.Llama(model_path=str(gguf_file_of(model_dir)), n_ctx=args.max_prompt + args.tokens + 8,
                          n_batch=args.max_prompt + 8, n_threads=args.threads, n_threads_batch=args.threads,
                          n_gpu_layers=0, logits_all=True, verbose=False, seed=0)
    rows = []
    for suite in ("humaneval", "gsm8k", "mt_bench"):
        for prompt in load_suite(suite, args.per_suite):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])[: args.max_prompt]
            a, b = ours_logits(model, ids), llama_logits(llm, ids)
            diff = np.abs(a - b)
            ga, ours_rate = ours_greedy(model, ids, args.tokens)
            gb, llama_rate = llama_greedy(llm, ids, args.tokens)
            row = {"suite": suite, "prompt": prompt.prompt_id, "positions": len(ids), "max_abs": float(diff.max()),
                   "mean_abs": float(diff.mean()), "logit_range": float(b.max() - b.min()),
                   "top1_agree": float((a.argmax(-1) == b.argmax(-1)).mean()),
                   "greedy_shared": shared_prefix(ga, gb), "greedy_tokens": args.tokens,
                   "ours_tok_s": ours_rate, "llama_tok_s": llama_rate}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.model}, {len(rows)} prompts, threads={args.threads}:")
    print(f"  logits max |diff| {max(r['max_abs'] for r in rows):.3f}, mean |diff| "
          f"{statistics.mean(r['mean_abs'] for r in rows):.4f}, top-1 agreement per position "
          f"{statistics.mean(r['top1_agree'] for r in rows):.1%}")
    full = sum(r["greedy_shared"] == args.tokens for r in rows)
    print(f"  greedy: identical {full}/{len(rows)} over {args.tokens} tokens, shared prefixes "
          f"{[r['greedy_shared'] for r in rows]}")
    print(f"  plain decoding tok/s (median): dflash2 gguf {statistics.median(r['ours_tok_s'] for r in rows):.2f}, "
          f"llama.cpp {statistics.median(r['llama_tok_s'] for r in rows):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
