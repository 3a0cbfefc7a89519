"""The Python entry point: ``engine = dflash2.load(); engine.generate("...")``."""

from __future__ import annotations

import torch

from dflash2.decode.engine import Engine
from dflash2.models.loading import load_transformer
from dflash2.models.tokenizer import Tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(
    target: str = "qwen2.5-coder-1.5b-instruct",
    *,
    drafter: str | None = "auto",
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
    num_candidates: int = 1,
    dtype: str = "bf16",
    weights: str = "bf16",
    device: str | None = None,
    pull: bool = True,
    pipeline: str | None = None,
    adaptive_draft: bool = False,
    draft_threads: int | None = None,
) -> Engine:
    """Load a target (model-store name, HF directory or .gguf path) and optionally a drafter.

    drafter: "auto" (the default: the drafter measured fastest for the target, ``dflash+ngram`` for the default
    target, else ``ngram``), "ngram" (prompt lookup), None / "none" (plain decoding), "model" (an independent small
    model of the same tokenizer, ``draft_model``; default: the store's pairing for the target), "dflash" (a trained
    block drafter: the one shipped for the target, or a directory in ``draft_model``), "dflash+ngram", "dflash2",
    "dflash2+ngram" (the shipped DFlash2 drafter). Every drafter is lossless. ``num_candidates`` > 1 makes the n-gram
    drafter verify a tree of continuations, and a block drafter a tree of k * num_candidates nodes (its
    chain and the likeliest branches through the block's top candidates).
    weights: "bf16" (not quantized, the default), "int8" or "int4" (weight-only, quantized at load time, CPU), for the
    target and the ``model`` drafter; speculation is lossless with respect to the quantized target.
    pipeline: "sync" or "overlap" (the drafter drafts the next block while the target verifies; None: the
    default for the device, see ``dflash2.decode.overlap.default_pipeline``); ``adaptive_draft`` picks the draft
    length per step from observed acceptance; ``draft_threads``: intra-op threads of the overlap drafter thread.
    """
    from dflash2.models.store import resolve_model

    device = device or default_device()
    target_dir = resolve_model(target, dtype, pull=pull)
    model = load_transformer(target_dir, dtype, device, weights=weights)
    tokenizer = Tokenizer(target_dir)
    from dflash2.decode.overlap import default_pipeline, default_draft_threads

    engine = Engine(model, tokenizer, name=target, pipeline=pipeline or default_pipeline(model.device),
                    adaptive_draft=adaptive_draft, draft_threads=draft_threads or default_draft_threads(model.device))
    if drafter not in (None, "none"):
        from dflash2.drafters import build_drafter

        engine.drafter = build_drafter(
            drafter, engine, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
            num_candidates=num_candidates, dtype=dtype, weights=weights, pull=pull,
        )
    return engine
