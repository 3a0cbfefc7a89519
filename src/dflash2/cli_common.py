"""What the ``dflash2`` commands share (generate, bench, serve): the one-line error, the model and drafter options,
loading the engine. Below the three CLI modules (``cli``, ``bench/cli``, ``serve/cli``), which import it and never
each other, except ``cli`` gathering the subcommands."""

from __future__ import annotations

import argparse

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"


class CliError(Exception):
    """An error to report in one line (no traceback)."""


def drafter_option(text: str) -> str:
    """argparse ``type`` of ``--drafter``: a valid spec ``name[:[L+]k[xW]]``, kept as written."""
    from dflash2.drafters.spec import DrafterSpec

    try:
        DrafterSpec.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def drafter_spec(args: argparse.Namespace):
    """The drafter of ``--drafter`` with ``-k`` / ``--num-candidates`` merged in (a DrafterSpec; CliError when they
    disagree with the spec's own k or W)."""
    from dflash2.drafters.spec import DrafterSpec

    try:
        return DrafterSpec.parse(args.drafter).merge(args.num_draft_tokens, args.num_candidates)
    except ValueError as error:
        raise CliError(str(error)) from None


def add_model_options(parser: argparse.ArgumentParser, *, drafter_choice: bool = True) -> None:
    """Options shared by every command that loads a target (and maybe a drafter)."""
    from dflash2.drafters.spec import DRAFTER_NAMES

    parser.add_argument("--model", "--target", dest="model", default=DEFAULT_MODEL,
                        help="model-store name or alias, HF directory, or .gguf path (default: %(default)s)")
    if drafter_choice:
        parser.add_argument("--drafter", type=drafter_option, default="auto", metavar="NAME[:[L+]K[xW]]",
                            help=f"draft method, one of {', '.join(DRAFTER_NAMES)}, optionally with its draft length "
                                 "K and tree width W (e.g. dflash2:2x3), for pard a lead L (pard:1+4x3); every one "
                                 "is lossless (default: auto, the one measured fastest for the target: pard+ngram "
                                 "for the default target (a 4x3 tree on AMX); serving it, pard+ngram on AMX, else "
                                 "dflash2+ngram; ngram for other targets)")
    parser.add_argument("--draft-model", default=None, help="small model for --drafter model (default: the pairing)")
    parser.add_argument("-k", "--num-draft-tokens", type=int, default=None,
                        help="drafts per step (the K of --drafter NAME:K; give it once; default: the drafter's)")
    parser.add_argument("--num-candidates", type=int, default=None,
                        help="tree width W (the W of --drafter NAME:KxW; give it once): ngram verifies W continuations "
                             "together as a tree; dflash / dflash2 a tree of k*W nodes, the chain and the likeliest "
                             "branches through the block's top candidates (default: 1, a chain)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--weights", default="bf16", choices=("bf16", "int8", "int4", "gguf"),
                        help="linear-layer weights of the target and draft model: bf16 (not quantized), int8 (per "
                             "channel) or int4 (groups of 32), weight-only, quantized at the first load; or gguf: the "
                             "GGUF file's own 4/5/6/8-bit blocks as they are, with activations quantized to int8 per 32 "
                             "like llama.cpp; CPU only, cached in the model store (DFLASH2_QUANT_CACHE=off: never "
                             "cached) (default: %(default)s)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    parser.add_argument("--pipeline", default=None,
                        help="sync (draft, then verify) | overlap (draft the next block while the target verifies); "
                             "bench takes a comma-separated list (default: the engine's default)")
    parser.add_argument("--draft-threads", type=int, default=None,
                        help="overlap: intra-op threads of the drafter's thread (default: 1 on CPU)")
    parser.add_argument("--adaptive-draft", action=argparse.BooleanOptionalAction, default=None,
                        help="choose the draft length per step from observed acceptance and measured costs (0 = "
                             "speculation off) (default: on with --weights gguf, where verifying several rows costs "
                             "most on a CPU; off otherwise)")


def load_engine(args: argparse.Namespace, spec=None, serving: bool = False):
    """The engine of the parsed model options (``--drafter`` merged with ``-k`` / ``--num-candidates``, unless the
    caller passes the spec); ``serving``: ``auto`` means the server's drafter (:func:`dflash2.load`)."""
    import torch

    import dflash2

    spec = spec if spec is not None else drafter_spec(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    return dflash2.load(
        args.model,
        drafter=spec,
        draft_model=args.draft_model,
        dtype=args.dtype,
        weights=args.weights,
        device=args.device,
        pipeline=args.pipeline,
        adaptive_draft=args.adaptive_draft,
        draft_threads=args.draft_threads,
        serving=serving,
    )
