"""``dflash2`` command line: generate | chat | models | bench | train | serve. A thin layer over the Python API.

The options and helpers the commands share are in :mod:`dflash2.cli_common` (below this module and the bench and
serve CLIs); ``CliError``, ``add_model_options`` and ``load_engine`` are also importable from here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from dflash2.cli_common import CliError, add_model_options, load_engine

__all__ = ["CliError", "add_model_options", "build_parser", "console", "load_engine", "main"]

DEFAULT_PROMPT_HINT = "Write a Python function that checks whether a number is prime."


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "serve"]:  # the serving benchmarks parse their own options
        from dflash2.bench.serve_cli import main as serve_bench

        return serve_bench(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args) or 0
    except KeyboardInterrupt:
        print("\ndflash2: interrupted", file=sys.stderr)
        return 130
    except (CliError, ValueError, FileNotFoundError, RuntimeError) as error:
        print(f"dflash2: error: {error}", file=sys.stderr)
        return 2


def console() -> None:
    """The ``dflash2`` executable: :func:`main`, then leave without the interpreter's teardown.

    Tearing down a loaded engine (freeing gigabytes of mapped and copied tensors one object at a time, joining
    torch's thread pools) costs about half a second of a one-shot command's wall time and does nothing the OS does
    not do at exit: nothing in dflash2 registers exit handlers, files are closed where they are written and locks
    are released by the OS. So the streams are flushed and the process ends at once."""
    code = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`dflash2 ... | head`): nothing left to say
            pass
    os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash2", description="Lossless speculative decoding for LLMs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command")
    _add_generate(commands)
    from dflash2.cli_chat import add_chat_parser

    add_chat_parser(commands)
    _add_models(commands)
    _add_kernels(commands)
    from dflash2.bench.cli import add_bench_parser
    from dflash2.serve.cli import add_serve_parser
    from dflash2.train.cli import add_train_parser

    add_bench_parser(commands)
    add_train_parser(commands)
    add_serve_parser(commands)
    return parser


def package_version() -> str:
    """The installed distribution's version (its metadata, what pip shows); the source tree's when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dflash2")
    except PackageNotFoundError:
        from dflash2 import __version__

        return __version__


def _add_generate(commands) -> None:
    p = commands.add_parser("generate", help="generate a completion", description="Generate a completion.")
    p.add_argument("prompt", help=f'the prompt, e.g. "{DEFAULT_PROMPT_HINT}"; - reads it from standard input')
    add_model_options(p)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one final JSON line with the text and stats")
    p.set_defaults(handler=run_generate)


def _add_models(commands) -> None:
    p = commands.add_parser("models", help="the model store: list | show | pull | verify | rm")
    sub = p.add_subparsers(dest="models_command", required=True)
    listing = sub.add_parser("list", help="known and stored models, with disk use")
    listing.add_argument("--json", action="store_true", help="one JSON document: the models and the store's disk use")
    listing.set_defaults(handler=run_models_list)
    show = sub.add_parser("show", help="what is stored for a model: files, sizes, formats, hashes, origin")
    show.add_argument("name", help="store name or alias, gguf-<sha12> (a converted .gguf), or a .gguf path")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=run_models_show)
    rm = sub.add_parser("rm", help="delete everything stored for models (GGUF, conversions, caches)")
    rm.add_argument("names", nargs="+", help="store names or aliases, gguf-<sha12> names, or .gguf paths")
    rm.set_defaults(handler=run_models_rm)
    pull = sub.add_parser("pull", help="download, assemble, verify and convert models")
    pull.add_argument("names", nargs="*", help="models to pull (default: the default target and its draft model)")
    pull.add_argument("--dtype", action="append", default=None, help="dtypes to convert to (default: bf16)")
    pull.set_defaults(handler=run_models_pull)
    verify = sub.add_parser("verify", help="re-check hashes and converted files")
    verify.add_argument("names", nargs="*", help="models to verify (default: every pulled model)")
    verify.add_argument("--repair", action="store_true",
                        help="rebuild what is damaged (assemble the GGUF again, convert again) instead of failing")
    verify.set_defaults(handler=run_models_verify)


def _add_kernels(commands) -> None:
    p = commands.add_parser("kernels", help="compile the CPU kernels ahead of the first generation")
    sub = p.add_subparsers(dest="kernels_command", required=True)
    build = sub.add_parser("build", help="compile (or find compiled) the kernels `generate` uses by default")
    build.add_argument("--all", action="store_true", help="also those of --weights int8 / int4 / gguf")
    build.set_defaults(handler=run_kernels_build)


def run_kernels_build(args: argparse.Namespace) -> int:
    from dflash2.kernels.prebuild import build_kernels

    for name, usable, status in build_kernels(everything=args.all):
        print(f"{name:44s} {'ok' if usable else 'not used'}: {status}")
    return 0


def validate_generation_args(args: argparse.Namespace) -> None:
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if not args.prompt.strip():
        raise CliError("the prompt is empty")
    if args.max_new_tokens <= 0:
        raise CliError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if args.num_draft_tokens is not None and args.num_draft_tokens <= 0:
        raise CliError(f"--num-draft-tokens must be > 0, got {args.num_draft_tokens}")


def run_generate(args: argparse.Namespace) -> int:
    validate_generation_args(args)
    engine = load_engine(args)
    stream = engine.stream(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        raw=args.raw,
    )
    while True:
        try:
            chunk = next(stream)
        except StopIteration as done:
            result = done.value
            break
        if not args.json:
            print(chunk.text, end="", flush=True)
    stats = result.stats
    if args.json:
        print(json.dumps(generation_json(result)))
    else:
        print()
        summary = (f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.2f} tok/s, prefill {stats.prefill_seconds:.2f}s "
                   f"({stats.prompt_tokens} prompt tokens), finish: {result.finish_reason}")
        if engine.drafter is not None:
            acceptance = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
            summary += (f", tau {stats.tau:.2f}, draft {stats.draft_seconds:.2f}s / verify {stats.verify_seconds:.2f}s"
                        f", acceptance by position: {acceptance}, pipeline {stats.pipeline}")
            if stats.pipeline == "overlap":
                summary += (f" (pre-draft hits {stats.predraft_hit_rate:.0%}, idle: target "
                            f"{stats.target_idle_fraction:.0%}, drafter {stats.drafter_idle_fraction:.0%})")
        print(summary + "]", file=sys.stderr)
    return 0


def generation_json(result) -> dict:
    stats = result.stats
    return {
        "text": result.text,
        "new_tokens": stats.new_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "seconds": round(stats.seconds, 4),
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "decode_seconds": round(stats.decode_seconds, 4),
        "tokens_per_s": round(stats.tokens_per_s, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "finish_reason": result.finish_reason,
        "tau": round(stats.tau, 4),
        "target_forwards": stats.target_forwards,
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
        "draft_seconds": round(stats.draft_seconds, 4),
        "verify_seconds": round(stats.verify_seconds, 4),
        "pipeline": stats.pipeline,
        "predraft_hit_rate": round(stats.predraft_hit_rate, 4),
        "target_idle_fraction": round(stats.target_idle_fraction, 4),
        "drafter_idle_fraction": round(stats.drafter_idle_fraction, 4),
        "token_ids": result.token_ids,
    }


def run_models_list(args: argparse.Namespace) -> int:
    from dflash2.models import inventory, store

    models = inventory.stored_models()
    usage = inventory.store_usage()
    if args.json:
        print(json.dumps({"home": str(store.home()), "models": [m.summary() for m in models],
                          "disk_bytes": usage}, indent=1))
        return 0
    print(f"{'NAME':30s} {'SIZE':>9s}  FORMATS")
    for model in models:
        aliases = f" ({', '.join(model.aliases)})" if model.aliases else ""
        formats = ", ".join(model.formats) or "not pulled"
        print(f"{model.name:30s} {human_bytes(model.size):>9s}  {formats}  -- {model.description}{aliases}")
    others = ", ".join(f"{name} {human_bytes(size)}" for name, size in usage.items() if name not in ("models", "gguf"))
    print(f"store {store.home()}: {human_bytes(sum(usage.values()))} in all" + (f" ({others})" if others else ""))
    return 0


def run_models_show(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from dflash2.models import inventory, store

    model = inventory.find(args.name)
    if args.json:
        print(json.dumps({**asdict(model), "size_bytes": model.size}, indent=1))
        return 0
    print(f"{model.name} ({model.kind}): {model.description}")
    if model.aliases:
        print(f"aliases: {', '.join(model.aliases)}")
    for key, value in model.source.items():
        print(f"{key}: {', '.join(value) if isinstance(value, list) else value}")
    print(f"stored under {store.home()}: {human_bytes(model.size)}" if model.parts else
          f"not stored; `dflash2 models pull {model.name}` fetches it")
    for part in model.parts:
        print(f"  {part.path}  [{part.format}]  {human_bytes(part.size)}")
        for file in part.files:
            digest = f"  sha256 {file.sha256}" if file.sha256 else ""
            print(f"    {Path(file.path).name:32s} {human_bytes(file.size):>9s}{digest}")
    return 0


def run_models_rm(args: argparse.Namespace) -> int:
    from dflash2.models import inventory

    for name in args.names:
        model, freed = inventory.remove(name)
        print(f"removed {model.name}: {human_bytes(freed)} freed ({', '.join(p.path for p in model.parts)})")
    return 0


def human_bytes(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def run_models_pull(args: argparse.Namespace) -> int:
    from dflash2.models import store

    names = args.names or [store.DEFAULT_TARGET, store.DEFAULT_DRAFT]
    for name in names:
        paths = store.pull(name, dtypes=tuple(args.dtype or ("bf16",)))
        for dtype, path in paths.items():
            print(f"{name} [{dtype}] -> {path}")
    return 0


def run_models_verify(args: argparse.Namespace) -> int:
    from dflash2.models import store

    names = args.names or [s.name for s in store.list_models() if s.pulled]
    if not names:
        raise CliError("no model is pulled; run `dflash2 models pull`")
    for name in names:
        if args.repair:
            rebuilt = store.repair(name)
            print(f"{name}: ok" + (f" (rebuilt {', '.join(rebuilt)})" if rebuilt else ""))
            continue
        store.verify(name)
        print(f"{name}: ok")
    return 0


if __name__ == "__main__":  # `python -m dflash2.cli`
    console()
