"""``dflash2 bench`` arguments and entry point."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_bench_parser(commands) -> None:
    from dflash2.bench.datasets import SUITES
    from dflash2.cli import add_model_options

    p = commands.add_parser("bench", help="benchmark drafters against plain decoding on eval suites")
    add_model_options(p, drafter_choice=False)
    p.add_argument("--suite", default="humaneval", help=f"comma-separated: {', '.join(SUITES)}")
    p.add_argument("--drafters", default="ngram,model", help="comma-separated drafters; plain decoding always runs")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (per category for spec_bench)")
    p.add_argument("--category", default=None, help="only these categories, comma-separated (e.g. summarization)")
    p.add_argument("--data", default=None, help="folder holding eval/ (default: ../shared/data or $DFLASH2_DATA)")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: humaneval + gsm8k, 2 prompts each, 64 new tokens (overrides those options)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/bench-<time>)")
    p.set_defaults(handler=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from dflash2.bench.datasets import load_suite
    from dflash2.bench.runner import BASELINE, BenchConfig, format_summary, method_name, run_bench, summarize
    from dflash2.cli import CliError, load_engine
    from dflash2.decode.overlap import PIPELINES
    from dflash2.drafters import DRAFTER_NAMES, build_drafter

    names = [BASELINE] + [m for m in args.drafters.split(",") if m and m != BASELINE]
    unknown = [m for m in names if m not in DRAFTER_NAMES]
    if unknown:
        raise CliError(f"unknown drafter(s) {', '.join(unknown)}; choose from {', '.join(DRAFTER_NAMES)}")
    pipelines = [p for p in (args.pipeline or "sync").split(",") if p]
    if not pipelines or any(p not in PIPELINES for p in pipelines):
        raise CliError(f"--pipeline takes a comma-separated list of {', '.join(PIPELINES)}, got {args.pipeline!r}")
    methods = list(dict.fromkeys(method_name(m, p) for m in names for p in pipelines))
    if args.max_new_tokens <= 0:
        raise CliError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.quick:
        args.suite, args.limit, args.max_new_tokens = "humaneval,gsm8k", 2, 64
    suites = tuple(s for s in args.suite.split(",") if s)
    prompts = [p for suite in suites for p in load_suite(suite, args.limit, data=args.data)]
    if args.category:
        wanted = set(args.category.split(","))
        prompts = [p for p in prompts if p.category in wanted]
        if not prompts:
            raise CliError(f"no prompt in categories {args.category!r} of suites {args.suite!r}")
    args.drafter, args.pipeline = "none", pipelines[0]
    engine = load_engine(args)
    built = {m: None if m == BASELINE else build_drafter(m, engine, draft_model=args.draft_model,
                                                         num_draft_tokens=args.num_draft_tokens,
                                                         num_candidates=args.num_candidates, dtype=args.dtype,
                                                         weights=args.weights)
             for m in names}
    drafters = {m: built[m.partition("@")[0]] for m in methods}  # one drafter object serves both pipelines
    out_dir = args.out or Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    config = BenchConfig(suites, tuple(methods), args.limit, args.max_new_tokens, out_dir, args.temperature)
    raw_path = run_bench(engine, drafters, prompts, config)
    summary = summarize(raw_path)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    print(f"raw per-request results: {raw_path}")
    return 0
