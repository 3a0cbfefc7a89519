#!/usr/bin/env python
"""Per-token cost of the target per weight format: one plain decoding step (1 row) and the verification of
8 and 16 drafts (9 and 17 rows, all logits; --rows sets them) at the same cache position, plus plain decoding
tokens/s, with the formats interleaved in every round (same process, same prompt, same threads).

    python scripts/kernels/bench_quant.py                                   # 1.5B target, bf16 / int8 / int4
    python scripts/kernels/bench_quant.py --model smollm2 --rounds 3 --decode-tokens 32
    python scripts/kernels/bench_quant.py --bandwidth 21                    # GB/s for the roofline column
    python scripts/kernels/bench_quant.py --threads 1 --cpu-time --agreement 2   # busy machine: CPU seconds, 1 thread
    python scripts/kernels/bench_quant.py --rounds 0 --pass-rate 10 --out runs/quant-pass   # accuracy only
    python scripts/kernels/bench_quant.py --formats bf16 --rows 1,3,7,13 --cached 200        # verification cost by rows
    python scripts/kernels/bench_quant.py --formats int8,gguf --rows 1,2,4,9,17 --threads 1 --cpu-time   # the GGUF's blocks
    python scripts/kernels/bench_quant.py --formats gguf@avx2,gguf@vnni --rows 1,4,9,17      # two gguf kernels, A/B

--cpu-time times with the process's CPU time instead of the wall clock (use with --threads 1): on a machine
shared with other jobs it measures what the work costs, not how long the scheduler kept it waiting.
--agreement N also decodes N HumanEval and N GSM8K prompts greedily with every format and reports how many
tokens each quantized format shares with bf16 before the first difference.
--pass-rate N answers the first N HumanEval and N GSM8K prompts with every format (chat template, the engine's
plain greedy decoding, up to --pass-tokens new tokens, stopping at EOS), scores them (dflash2.bench.accuracy:
the final number for GSM8K, the task's tests in a separate `python -I` for HumanEval) and reports per format and
suite the pass rate, the responses identical to the first format's and where the others first differ; the
per-prompt rows (texts included) go to --out/pass_rate.jsonl.  --rounds 0 skips the timing.

Roofline: the bytes of linear-layer weights read per decoding step (packed bf16: 2 B per weight; int8: 1 B +
4 B per output; int4: 0.5 B + 4 B per 32 weights; gguf: the packed blocks and their scales) over --bandwidth GB/s
(scripts/kernels/bench_kernels.py measures the machine's read bandwidth); the plain decoding rate is compared with it.
Times are medians over rounds; the row ratios are also given per round (each pass over the first --rows pass of
its round, a few seconds apart), the steadier measure where the machine's speed drifts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from dflash2.bench.accuracy import SCORED_SUITES, first_divergence, load_references, pass_rate_table, score
from dflash2.bench.accuracy import summarize_pass_rates
from dflash2.bench.datasets import BenchPrompt, load_suite
from dflash2.decode.engine import Engine
from dflash2.kernels import PackedLinear, gguf_linear
from dflash2.kernels.gguf_linear import GgufLinear
from dflash2.kernels.quant_linear import QuantLinear
from dflash2.models.loading import load_transformer
from dflash2.models.store import resolve_model
from dflash2.models.tokenizer import Tokenizer
from dflash2.platform import cpu, reload_settings

clock = time.perf_counter  # or time.process_time (--cpu-time)


def weight_bytes(model) -> int:
    """Bytes of linear-layer weights (and scales) a decoding step reads."""
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += module.weight_data.numel() * module.weight_data.element_size()
        elif isinstance(module, QuantLinear):
            total += module.weight_data.numel() * module.weight_data.element_size()
            total += module.scale_data.numel() * module.scale_data.element_size()
        elif isinstance(module, GgufLinear):
            total += module.nbytes
    return total


@torch.inference_mode()
def forward_ms(model, cache, start: int, rows: int) -> float:
    """One target pass over ``rows`` new tokens after ``start`` cached ones (logits for all rows), then rollback."""
    ids = torch.randint(0, model.config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(rows))
    cache.rollback(start)
    t0 = clock()
    model(ids, cache=cache, logits="all")
    elapsed = clock() - t0
    cache.rollback(start)
    return elapsed * 1e3


@torch.inference_mode()
def greedy(model, prompt: torch.Tensor, tokens: int) -> tuple[list[int], float]:
    """Plain greedy decoding of ``tokens`` tokens: (ids, decode tokens/s after the prefill's first token)."""
    cache = model.new_cache(len(prompt) + tokens + 1)
    token = model(prompt[None], cache=cache, logits="last").logits[0, -1].argmax()
    ids = [int(token)]
    t0 = clock()
    for _ in range(tokens - 1):
        token = model(token.view(1, 1), cache=cache, logits="last").logits[0, -1].argmax()
        ids.append(int(token))
    return ids, (tokens - 1) / (clock() - t0)


def load_format(model_dir: Path, fmt: str):
    """A model in weight format ``fmt``; ``gguf@<kernel>`` (amx, avx2, vnni, torch) also names the gguf kernel."""
    weights, _, kernel = fmt.partition("@")
    if not kernel:
        return load_transformer(model_dir, "bf16", weights=weights)
    if weights != "gguf":
        raise SystemExit(f"--formats {fmt}: only gguf takes a kernel (gguf@amx, gguf@vnni, gguf@avx2, gguf@torch)")
    before = os.environ.get(gguf_linear.ENV)
    os.environ[gguf_linear.ENV] = kernel
    reload_settings()  # (parsed once per process otherwise)
    try:
        return load_transformer(model_dir, "bf16", weights=weights)
    finally:
        if before is None:
            os.environ.pop(gguf_linear.ENV)
        else:
            os.environ[gguf_linear.ENV] = before
        reload_settings()


def agreement(models, model_dir, per_suite: int, tokens: int) -> dict[str, list[int]]:
    """Tokens each format shares with the first (bf16) before the first difference, per eval prompt."""
    tokenizer = Tokenizer(model_dir)
    prompts = [p for suite in ("humaneval", "gsm8k") for p in load_suite(suite, per_suite)]
    shared: dict[str, list[int]] = {fmt: [] for fmt in models}
    for prompt in prompts:
        ids = torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}]))
        outputs = {fmt: greedy(model, ids, tokens)[0] for fmt, model in models.items()}
        reference = next(iter(outputs.values()))
        for fmt, out in outputs.items():
            same = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), len(out))
            shared[fmt].append(same)
        print(f"agreement {prompt.suite}/{prompt.prompt_id}: " + ", ".join(f"{f} {v[-1]}/{tokens}" for f, v in shared.items()),
              flush=True)
    return shared


def pass_rates(models, model_dir, per_suite: int, tokens: int) -> list[dict]:
    """Greedy chat responses of every format to the first ``per_suite`` prompts of each scored suite, scored:
    one row per (prompt, format)."""
    tokenizer = Tokenizer(model_dir)
    engines = {fmt: Engine(model, tokenizer, name=fmt) for fmt, model in models.items()}  # drafter None: plain
    rows = []
    for suite in SCORED_SUITES:
        references = load_references(suite)
        for prompt in load_suite(suite, per_suite):
            rows += prompt_rows(engines, prompt, references[prompt.prompt_id], tokens)
    return rows


def prompt_rows(engines: dict[str, Engine], prompt: BenchPrompt, reference, tokens: int) -> list[dict]:
    results = {fmt: engine.generate(prompt.text, max_new_tokens=tokens) for fmt, engine in engines.items()}
    baseline = next(iter(results.values())).token_ids
    rows = []
    for fmt, result in results.items():
        verdict = score(reference, result.text)
        rows.append({"suite": prompt.suite, "prompt_id": prompt.prompt_id, "weights": fmt, "passed": verdict.passed,
                     "detail": verdict.detail, "first_divergence": first_divergence(result.token_ids, baseline),
                     "new_tokens": len(result.token_ids), "finish_reason": result.finish_reason,
                     "decode_tokens_per_s": result.stats.decode_tokens_per_s, "text": result.text,
                     "token_ids": result.token_ids})
    print(f"pass {prompt.suite}/{prompt.prompt_id}: " + ", ".join(
        f"{r['weights']} {'ok' if r['passed'] else 'fail'} ({r['detail'][:40]}; {r['new_tokens']} tok, "
        f"diverges {'-' if r['first_divergence'] is None else r['first_divergence']})" for r in rows), flush=True)
    return rows


def write_pass_rates(rows: list[dict], formats: list[str], out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "pass_rate.jsonl", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    table = pass_rate_table(summarize_pass_rates(rows), formats[0])
    header = (f"model={args.model} prompts per suite={args.pass_rate} max new tokens={args.pass_tokens} "
              "(greedy, chat template, plain decoding)")
    (out / "pass_rate.md").write_text(header + "\n\n" + table + "\n")
    print(f"\n{header}\n\n{table}\n\nrows: {out / 'pass_rate.jsonl'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--formats", default="bf16,int8,int4")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--bandwidth", type=float, default=21.0, help="machine read bandwidth in GB/s")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time (with --threads 1)")
    ap.add_argument("--agreement", type=int, default=0, help="greedy agreement on N prompts per suite")
    ap.add_argument("--agreement-tokens", type=int, default=64)
    ap.add_argument("--pass-rate", type=int, default=0, help="score greedy responses to N prompts per suite")
    ap.add_argument("--pass-tokens", type=int, default=384, help="max new tokens per --pass-rate response")
    ap.add_argument("--out", type=Path, default=None, help="--pass-rate rows (default: runs/quant-pass-<time>)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--rows", default="1,9,17",
                    help="rows of the timed passes, ratios against the first (default: a plain step, 8 and 16 drafts)")
    ap.add_argument("--cached", type=int, default=64, help="positions cached before each timed pass")
    args = ap.parse_args()
    if args.rounds < 0 or args.pass_rate < 0 or args.pass_tokens <= 0 or args.cached <= 0:
        ap.error("--rounds and --pass-rate must be >= 0, --pass-tokens and --cached > 0")
    try:
        args.rows = tuple(int(r) for r in args.rows.split(","))
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(args.rows) <= 0:
        ap.error("--rows must be positive")
    if args.cpu_time:
        global clock
        clock = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    model_dir = resolve_model(args.model, "bf16")
    models = {}
    for fmt in formats:
        t0 = time.perf_counter()
        models[fmt] = load_format(model_dir, fmt)
        print(f"loaded {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)
    prompt = torch.randint(0, 1000, (args.cached,), generator=torch.Generator().manual_seed(0))
    caches = {}
    with torch.inference_mode():
        for fmt, model in models.items():
            caches[fmt] = model.new_cache(args.cached + max(args.rows) + 1)
            model(prompt[None], cache=caches[fmt], logits="none")
    times = {(fmt, rows): [] for fmt in formats for rows in args.rows}
    rates = {fmt: [] for fmt in formats}
    for round_index in range(args.rounds):
        for fmt in formats:  # interleaved: every format in every round
            for rows in args.rows:
                times[(fmt, rows)].append(forward_ms(models[fmt], caches[fmt], args.cached, rows))
            rates[fmt].append(greedy(models[fmt], prompt, args.decode_tokens)[1])
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    shared = agreement(models, model_dir, args.agreement, args.agreement_tokens) if args.agreement else {}
    report(formats, models, times, rates, shared, args)
    if args.pass_rate:
        rows = pass_rates(models, model_dir, args.pass_rate, args.pass_tokens)
        write_pass_rates(rows, formats, args.out or Path("runs") / time.strftime("quant-pass-%Y%m%d-%H%M%S"), args)


def report(formats, models, times, rates, shared, args) -> None:
    if args.rounds:
        timing_table(formats, models, times, rates, shared, args)
    for fmt, same in shared.items():
        full = sum(s == args.agreement_tokens for s in same)
        print(f"greedy agreement with {formats[0]}, {fmt}: identical {full}/{len(same)}, shared tokens {same}")


# The CPU features that decide which kernels run (docs/kernels.md): printed with every table, since the row ratios
# depend on them far more than on the model.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_line() -> str:
    """``model name`` and the kernel-relevant flags of this CPU (:func:`dflash2.platform.cpu`)."""
    info = cpu()
    flags = " ".join(f for f in KERNEL_FLAGS if f in info.flags)
    return (f"cpu: {info.name or info.machine} (vendor {info.vendor}, family {info.family}, model {info.model}); "
            f"flags: {flags}")


def round_ratios(ms: list[float], base_ms: list[float]) -> list[float]:
    """Each round's time over the base pass's time of the same round: on a shared machine whose speed drifts
    (docs/benchmarking.md, "On a shared machine") the passes of one round see about the same machine."""
    return [a / b for a, b in zip(ms, base_ms)]


def timing_table(formats, models, times, rates, shared, args) -> None:
    print(f"\n{cpu_line()}\nthreads={torch.get_num_threads()} model={args.model} rounds={args.rounds} "
          f"clock={clock.__name__} cached={args.cached} (medians; formats interleaved)")
    base, more = args.rows[0], args.rows[1:]
    header = " | ".join([f"{'weights':>9}", f"{'GB/step':>7}", *(f"{r} rows ms" for r in args.rows),
                         *(f"{r}/{base}" for r in more), "plain tok/s", "roofline tok/s", "of roofline"])
    print(header + "\n" + "-" * len(header))
    results = []
    for fmt in formats:
        gb = weight_bytes(models[fmt]) / 1e9
        ms = {rows: statistics.median(times[(fmt, rows)]) for rows in args.rows}
        rate = statistics.median(rates[fmt])
        roof = args.bandwidth / gb
        cells = [f"{fmt:>9}", f"{gb:7.2f}", *(f"{ms[r]:{len(str(r)) + 8}.1f}" for r in args.rows),
                 *(f"{ms[r] / ms[base]:{len(f'{r}/{base}')}.2f}" for r in more), f"{rate:11.2f}", f"{roof:14.1f}",
                 f"{rate / roof:11.0%}"]
        print(" | ".join(cells))
        per_round = {r: round_ratios(times[(fmt, r)], times[(fmt, base)]) for r in more}
        results.append({"weights": fmt, "gb_per_step": gb, "ms": ms, "plain_tokens_per_s": rate,
                        "roofline_tokens_per_s": roof, "all_ms": {r: times[(fmt, r)] for r in args.rows},
                        "ratio_per_round": per_round, "all_rates": rates[fmt],
                        "agreement_shared_tokens": shared.get(fmt)})
    print(f"\nper round (the {base}-row pass and each other pass of one round, a few seconds apart): median (range)")
    for row in results:
        ratios = row["ratio_per_round"].items()
        print(f"{row['weights']:>9}: " + ", ".join(
            f"{r}/{base} {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" for r, v in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_line(), "cached": args.cached, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
