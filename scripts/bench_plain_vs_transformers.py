"""Plain decoding speed: dflash2's lean decoder vs transformers' `generate`, same weights, dtype and prompt.

Also measures this machine's read bandwidth and reports each engine's fraction of the bandwidth roofline
(bytes of weights read per token / measured bandwidth). Run:

    .venv/bin/python scripts/bench_plain_vs_transformers.py --model qwen2.5-coder-1.5b-instruct --tokens 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPT = "Write a Python function that checks whether a number is prime."


def time_lean(engine, tokens: int) -> float:
    result = engine.generate(PROMPT, max_new_tokens=tokens, stop=())
    return result.stats.decode_tokens_per_s


def time_transformers(hf_model, prompt_ids: torch.Tensor, tokens: int) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        hf_model.generate(prompt_ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = hf_model.generate(prompt_ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        elapsed = time.perf_counter() - start - prefill
    return (out.shape[1] - prompt_ids.shape[1] - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import dflash2
    from dflash2.bench.roofline import measure_read_bandwidth, weight_bytes_per_token
    from dflash2.models.store import resolve_model
    from transformers import AutoModelForCausalLM

    engine = dflash2.load(args.model, drafter="none", dtype=args.dtype)
    model_dir = resolve_model(args.model, args.dtype)
    torch_dtype = engine.target.dtype
    hf_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    prompt_ids = torch.tensor([engine.encode_prompt(PROMPT)])
    time_lean(engine, 8), time_transformers(hf_model, prompt_ids, 8)  # warm-up
    lean, hf = [], []
    for _ in range(args.rounds):  # interleaved: both see the same machine state
        lean.append(time_lean(engine, args.tokens))
        hf.append(time_transformers(hf_model, prompt_ids, args.tokens))
    bandwidth = measure_read_bandwidth()
    bytes_per_token = weight_bytes_per_token(engine.target.config, engine.target.dtype.itemsize)
    roofline = bandwidth * 1e9 / bytes_per_token
    best_lean, best_hf = max(lean), max(hf)
    report = {
        "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(), "new_tokens": args.tokens,
        "dflash2_tokens_per_s": lean, "transformers_tokens_per_s": hf,
        "speed_ratio_best": best_lean / best_hf,
        "read_bandwidth_GBps": bandwidth, "weight_bytes_per_token": bytes_per_token,
        "roofline_tokens_per_s": roofline,
        "dflash2_fraction_of_roofline": best_lean / roofline, "transformers_fraction_of_roofline": best_hf / roofline,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
