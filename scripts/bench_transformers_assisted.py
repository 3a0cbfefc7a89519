"""transformers' assisted generation (the 0.5B drafting for the 1.5B) and plain `generate` on dflash2's bench prompts.

Same weights (the model store's converted directories), dtype, chat template, greedy, max_new_tokens and threads as
`dflash2 bench`; prints per-prompt decode tokens/s and writes JSONL. Run:

    .venv/bin/python scripts/bench_transformers_assisted.py --suite humaneval,gsm8k --limit 4 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed_generate(model, prompt_ids: torch.Tensor, max_new_tokens: int, **kwargs) -> tuple[list[int], float]:
    """Greedy generation; returns (new ids, decode tokens/s with the prefill's first token excluded)."""
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(prompt_ids, max_new_tokens=1, do_sample=False, **kwargs)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(prompt_ids, max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
        elapsed = time.perf_counter() - start
    new_ids = out[0, prompt_ids.shape[1] :].tolist()
    return new_ids, max(len(new_ids) - 1, 0) / max(elapsed - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default="humaneval,gsm8k")
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--out", type=Path, default=Path("runs/transformers-assisted.jsonl"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from dflash2.bench.datasets import load_suite
    from dflash2.models.loading import parse_dtype
    from dflash2.models.store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from dflash2.models.tokenizer import Tokenizer

    dtype = parse_dtype(args.dtype)
    target_dir = resolve_model(DEFAULT_TARGET, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(resolve_model(DEFAULT_DRAFT, args.dtype)), dtype=dtype).eval()
    tokenizer = Tokenizer(target_dir)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as sink:
        for suite in args.suite.split(","):
            for prompt in load_suite(suite, args.limit):
                ids = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])])
                plain_ids, plain_tps = timed_generate(target, ids, args.max_new_tokens)
                assisted_ids, assisted_tps = timed_generate(target, ids, args.max_new_tokens, assistant_model=draft)
                row = {"category": prompt.category, "prompt_id": prompt.prompt_id, "plain_tokens_per_s": plain_tps,
                       "assisted_tokens_per_s": assisted_tps, "speedup": assisted_tps / plain_tps,
                       "identical": assisted_ids == plain_ids}
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                print(json.dumps(row))


if __name__ == "__main__":
    main()
