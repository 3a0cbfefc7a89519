"""The Python entry point: ``engine = dflash2.load(); engine.generate("...")``."""

from __future__ import annotations

import torch

from dflash2.decode.engine import Engine
from dflash2.drafters import DraftTarget, DrafterSpec, build_drafter
from dflash2.models.loading import load_transformer
from dflash2.models.tokenizer import Tokenizer


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load(
    target: str = "qwen2.5-coder-1.5b-instruct",
    *,
    drafter: str | DrafterSpec | None = "auto",
    draft_model: str | None = None,
    num_draft_tokens: int | None = None,
    num_candidates: int | None = None,
    dtype: str = "bf16",
    weights: str = "bf16",
    device: str | None = None,
    pull: bool = True,
    pipeline: str | None = None,
    adaptive_draft: bool | None = None,
    draft_threads: int | None = None,
    prefix_cache: bool = True,
    serving: bool = False,
) -> Engine:
    """Load a target (model-store name, HF directory or .gguf path) and optionally a drafter.

    drafter: a spec ``name[:[L+]k[xW]]`` (:class:`~dflash2.drafters.spec.DrafterSpec`; e.g. ``"dflash2:2x3"``: draft
    length k = 2, a tree of width W = 3; ``"pard:1+4x3"``: one lead draft, then that tree). Names: "auto" (the
    default: the drafter measured fastest for the target, ``pard+ngram`` for the default target, else ``ngram``;
    ``serving`` picks the server's, see below), "ngram" (prompt lookup), None / "none" (plain decoding), "model" (an
    independent small model of the same tokenizer, ``draft_model``; default: the store's pairing for the target),
    "dflash" (a trained block drafter: the one shipped for the target, or a directory in ``draft_model``),
    "dflash+ngram", "dflash2", "dflash2+ngram" (the shipped DFlash2 drafter). Every drafter is lossless.
    ``num_draft_tokens`` / ``num_candidates`` give k / W when the spec does not (a ValueError when both give one and
    disagree); unset, k is the drafter's default (``dflash2.drafters.spec.DEFAULT_NUM_DRAFT_TOKENS``) and W is 1, a
    chain. W > 1 makes the n-gram drafter verify a tree of W continuations, and a block drafter a tree of k * W
    nodes (its chain and the likeliest branches through the block's top candidates).
    weights: "bf16" (not quantized, the default), "int8" or "int4" (weight-only, quantized at load time, CPU), or
    "gguf" (the model file's own 4/5/6/8-bit blocks as they are, activations quantized per row as llama.cpp does;
    CPU with AVX2), for the target and the ``model`` drafter; speculation is lossless with respect to the quantized
    target.
    pipeline: "sync" or "overlap" (the drafter drafts the next block while the target verifies; None: the default for
    the device, see ``dflash2.decode.overlap.default_pipeline``); ``adaptive_draft`` picks the draft length per step
    from observed acceptance (None: on for gguf weights only, ``default_adaptive_draft``); ``draft_threads``:
    intra-op threads of the overlap drafter thread.
    prefix_cache: keep the last generation's KV cache (one sequence) and start the next call from the longest
    prefix its prompt shares with it, so a chat called turn after turn prefills only the new turn (not with the
    overlapped pipeline); ``engine.clear_cache()`` frees it. The output is the same either way.
    serving: ``auto`` means the drafter measured fastest in the batch server (``dflash2 serve``, 8 concurrent
    clients): ``pard+ngram`` where the target verifies on AMX tiles, else ``dflash2+ngram``, for the default target.
    """
    from dflash2.decode.draft_length import default_adaptive_draft
    from dflash2.decode.overlap import default_draft_threads, default_pipeline
    from dflash2.models.store import resolve_model

    spec = DrafterSpec.parse(drafter).merge(num_draft_tokens, num_candidates)  # a bad spec fails before any load
    device = device or default_device()
    target_dir = resolve_model(target, dtype, pull=pull)
    model = load_transformer(target_dir, dtype, device, weights=weights)
    tokenizer = Tokenizer(target_dir)
    built = None
    if spec.drafts:
        built = build_drafter(spec, DraftTarget(model, tokenizer, target), draft_model=draft_model, dtype=dtype,
                              weights=weights, pull=pull, serving=serving)
    return Engine(model, tokenizer, drafter=built, name=target, pipeline=pipeline or default_pipeline(model.device),
                  adaptive_draft=default_adaptive_draft(weights) if adaptive_draft is None else adaptive_draft,
                  draft_threads=draft_threads or default_draft_threads(model.device),
                  prefix_cache=prefix_cache)
