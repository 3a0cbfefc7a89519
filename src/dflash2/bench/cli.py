"""``dflash2 bench`` arguments and entry point."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash2.cli_common import CliError, add_model_options, load_engine


def add_bench_parser(commands) -> None:
    from dflash2.bench.datasets import SUITES

    p = commands.add_parser("bench", help="benchmark drafters against plain decoding on eval suites",
                            description="dflash2 bench [options] runs a benchmark; "
                                        "dflash2 bench report RUN_DIR [--html] writes its report; "
                                        "dflash2 bench serve http|batch|load|ttft [options] runs a serving "
                                        "benchmark (dflash2 bench serve --help)")
    p.add_argument("action", nargs="?", choices=("report",), help="report: write RUN_DIR's Markdown report")
    p.add_argument("run_dir", nargs="?", type=Path, help="the run directory to report on")
    p.add_argument("--html", action="store_true", help="report: also write report.html")
    add_model_options(p, drafter_choice=False)
    p.add_argument("--suite", default="humaneval", help=f"comma-separated: {', '.join(SUITES)}")
    p.add_argument("--drafters", default="ngram,model",
                   help="comma-separated drafter specs NAME[:[L+]K[xW]]: name:k sets that drafter's draft length "
                        "(over -k), name:kxW also a tree of width W (W n-gram continuations, k*W block-drafter "
                        "nodes; over --num-candidates), pard:L+k first L drafts one per pass; plain decoding always "
                        "runs")
    p.add_argument("--limit", type=int, default=None, help="first N prompts (per category for spec_bench)")
    p.add_argument("--category", default=None, help="only these categories, comma-separated (e.g. summarization)")
    p.add_argument("--data", default=None, help="folder holding eval/ (default: $DFLASH2_DATA, else the checkout's data/)")
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: humaneval + gsm8k, 2 prompts each, 64 new tokens (overrides those options)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/bench-<time>)")
    p.add_argument("--peers", default=None,
                   help="other tools on the same prompts, comma-separated or all: transformers, transformers-assisted, "
                        "transformers-pld, llamacpp, llamacpp-spec, llamacpp-dflash, llamacpp-ngram (needs the "
                        "peers extra)")
    p.add_argument("--peer-dflash-drafter", default=None,
                   help="llamacpp-dflash: a DFlash drafter in llama.cpp's layout (default: the one shipped for the "
                        "target, where it has that layout)")
    p.set_defaults(handler=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    if args.action == "report":
        return _report_command(args)
    from dflash2.bench.datasets import load_suites
    from dflash2.bench.runner import BASELINE, BenchConfig, format_summary, method_name, run_bench, summarize
    from dflash2.decode.overlap import PIPELINES
    from dflash2.drafters import build_drafter

    names = [BASELINE] + [m for m in args.drafters.split(",") if m and m != BASELINE]
    specs = {m: _bench_spec(m, args.num_draft_tokens, args.num_candidates) for m in names}  # "dflash:3x2" etc.
    pipelines = [p for p in (args.pipeline or "sync").split(",") if p]
    if not pipelines or any(p not in PIPELINES for p in pipelines):
        raise CliError(f"--pipeline takes a comma-separated list of {', '.join(PIPELINES)}, got {args.pipeline!r}")
    methods = list(dict.fromkeys(method_name(m, p) for m in names for p in pipelines))
    if args.max_new_tokens <= 0:
        raise CliError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.quick:
        args.suite, args.limit, args.max_new_tokens = "humaneval,gsm8k", 2, 64
    suites = tuple(s for s in args.suite.split(",") if s)
    prompts = load_suites(suites, args.limit, data=args.data)
    if args.category:
        wanted = set(args.category.split(","))
        prompts = [p for p in prompts if p.category in wanted]
        if not prompts:
            raise CliError(f"no prompt in categories {args.category!r} of suites {args.suite!r}")
    args.drafter, args.pipeline = "none", pipelines[0]
    engine = load_engine(args)
    built = {m: None if m == BASELINE else build_drafter(specs[m], engine, draft_model=args.draft_model,
                                                         dtype=args.dtype, weights=args.weights)
             for m in names}
    drafters = {m: built[m.partition("@")[0]] for m in methods}  # one drafter object serves both pipelines
    peers, run_extra = _peers_and_roofline(args, engine, prompts)
    out_dir = args.out or Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    config = BenchConfig(suites, tuple(methods), args.limit, args.max_new_tokens, out_dir, args.temperature)
    raw_path = run_bench(engine, drafters, prompts, config, peers=peers, run_extra=run_extra)
    summary = summarize(raw_path)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    print(f"raw per-request results: {raw_path}")
    return 0


def _peers_and_roofline(args: argparse.Namespace, engine, prompts) -> tuple[list, dict]:
    """Peers requested by --peers (loaded now), and the roofline inputs measured on this machine."""
    from dflash2.bench.roofline import gguf_bytes_per_token, measure_read_bandwidth, weight_bytes_per_token
    from dflash2.peers import PeerError, build_peers, parse_peer_names

    names = parse_peer_names(args.peers)
    extra = {"read_bandwidth_GBps": measure_read_bandwidth(),
             "weight_bytes_per_token": weight_bytes_per_token(engine.target.config, engine.target.dtype.itemsize)}
    if not names:
        return [], extra
    setup = _peer_setup(args, engine, prompts)
    try:
        peers = build_peers(names, setup)
    except PeerError as error:
        raise CliError(str(error)) from error
    gguf_bytes, gguf_types = gguf_bytes_per_token(setup.target_gguf)
    extra |= {"gguf_bytes_per_token": gguf_bytes, "gguf_tensor_types": gguf_types,
              "target_gguf": str(setup.target_gguf), "draft_gguf": str(setup.draft_gguf),
              "peer_num_draft_tokens": setup.num_draft_tokens}
    return peers, extra


def _peer_setup(args: argparse.Namespace, engine, prompts):
    import torch

    from dflash2.models.store import canonical_name, default_draft, gguf_path, resolve_model
    from dflash2.peers import PeerSetup

    target = canonical_name(args.model)
    if target is None:
        raise CliError(f"--peers needs a model-store target (its GGUF file feeds llama.cpp), got {args.model!r}")
    draft = canonical_name(args.draft_model) if args.draft_model else default_draft(target)
    if args.draft_model and draft is None:
        raise CliError(f"--peers needs a model-store draft model, got {args.draft_model!r}")
    longest = max(len(engine.encode_prompt(p.text)) for p in prompts)
    n_ctx = -(-(longest + args.max_new_tokens + 64) // 256) * 256
    return PeerSetup(
        target_dir=resolve_model(target, args.dtype), target_gguf=gguf_path(target),
        draft_dir=resolve_model(draft, args.dtype) if draft else None, draft_gguf=gguf_path(draft) if draft else None,
        dtype=args.dtype, threads=torch.get_num_threads(), eos_ids=frozenset(engine.tokenizer.eos_token_ids),
        n_ctx=n_ctx, num_draft_tokens=args.num_draft_tokens,
        dflash_drafter=Path(args.peer_dflash_drafter) if args.peer_dflash_drafter else _llama_cpp_dflash(target))


def _llama_cpp_dflash(target: str):
    """The DFlash drafter shipped for ``target`` if llama.cpp can load its layout, else None."""
    from dflash2.drafters import shipped_dflash_drafter
    from dflash2.drafters.dflash_config import CONFIG_FILE, DFlashConfig
    from dflash2.train.export import dflash_layout_problems

    try:
        directory = shipped_dflash_drafter(target)
    except ValueError:
        return None
    config = DFlashConfig.from_hf_dict(json.loads((directory / CONFIG_FILE).read_text()))  # no weights read
    return None if dflash_layout_problems(config) else directory


def _report_command(args: argparse.Namespace) -> int:
    from dflash2.bench.report import write_report

    if args.run_dir is None:
        raise CliError("dflash2 bench report needs the run directory: dflash2 bench report RUN_DIR")
    md_path, table = write_report(args.run_dir, html_page=args.html)
    print(table)
    print(f"report: {md_path}" + (f" and {md_path.with_suffix('.html')}" if args.html else ""))
    return 0


def _bench_spec(method: str, default_k: int | None, default_candidates: int | None):
    """The DrafterSpec of a ``--drafters`` entry ``name[:[L+]k[xW]]``: its own k and W, else ``-k`` and
    ``--num-candidates`` (defaults for every entry, so an entry's own shape wins over them)."""
    from dflash2.drafters.spec import DrafterSpec

    try:
        spec = DrafterSpec.parse(method)
        if not spec.drafts:
            return spec
        return DrafterSpec(spec.name, spec.num_draft_tokens or default_k, spec.num_candidates or default_candidates,
                           spec.lead_tokens)
    except ValueError as error:
        raise CliError(f"--drafters: {error}") from None


def _draft_shape(method: str, default_k: int | None, default_candidates: int | None) -> tuple[int | None, int]:
    """(draft length, candidates) of a ``--drafters`` entry (see :func:`_bench_spec`; W 1 when neither sets it)."""
    spec = _bench_spec(method, default_k, default_candidates)
    return spec.num_draft_tokens, spec.width
