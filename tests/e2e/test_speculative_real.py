"""Greedy speculative decoding on real weights (fp32) reproduces plain greedy decoding token for token."""

from __future__ import annotations

import functools

import pytest

from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from tests.e2e.conftest import QWEN_DRAFT, QWEN_TARGET, SMOLLM2, lean_engine, model_dir

CODE_PROMPT = "Write a Python class for a stack with push, pop and peek, then a function that reverses a string with it."


def generate_with(engine, drafter, prompt, **kwargs):
    engine.drafter = drafter
    try:
        return engine.generate(prompt, **kwargs)
    finally:
        engine.drafter = None


@functools.lru_cache(maxsize=None)
def plain_result(name: str, prompt: str, max_new_tokens: int):
    """Plain greedy decoding, computed once per (model, prompt) for all the drafters compared with it."""
    return lean_engine(name, "fp32").generate(prompt, max_new_tokens=max_new_tokens)


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
def test_smollm2_drafters_are_lossless(k):
    engine = lean_engine(SMOLLM2, "fp32")
    plain = plain_result(SMOLLM2, CODE_PROMPT, 64)
    ngram = generate_with(engine, NgramDrafter(k, stop_ids=engine.tokenizer.eos_token_ids), CODE_PROMPT, max_new_tokens=64)
    itself = generate_with(engine, ModelDrafter(engine.target, k), CODE_PROMPT, max_new_tokens=64)
    assert ngram.token_ids == plain.token_ids
    assert itself.token_ids == plain.token_ids
    assert itself.stats.accepted_by_position == itself.stats.drafted_by_position  # drafter == target: all accepted


@pytest.mark.model
def test_eos_inside_a_draft_ends_the_output_exactly_like_plain():
    """The drafter (== target) drafts through the EOS; nothing after it may be emitted."""
    engine = lean_engine(SMOLLM2, "fp32")
    prompt = "Reply with one word: hello."
    plain = engine.generate(prompt, max_new_tokens=100)
    assert plain.finish_reason == "eos"
    spec = generate_with(engine, ModelDrafter(engine.target, 8), prompt, max_new_tokens=100)
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    assert spec.finish_reason == "eos"


@pytest.mark.model
@pytest.mark.qwen
def test_qwen_pair_is_lossless_with_the_small_model_and_ngram_drafters():
    """32 tokens (the longest fp32 test of the default run at 64; SmolLM2 above covers long outputs)."""
    engine = lean_engine(QWEN_TARGET, "fp32")
    draft = load_transformer(model_dir(QWEN_DRAFT, "fp32"), "fp32")
    plain = plain_result(QWEN_TARGET, CODE_PROMPT, 32)
    small = generate_with(engine, ModelDrafter(draft, 4), CODE_PROMPT, max_new_tokens=32)
    lookup = NgramDrafter(8, stop_ids=engine.tokenizer.eos_token_ids)
    ngram = generate_with(engine, lookup, CODE_PROMPT, max_new_tokens=32)
    assert small.token_ids == plain.token_ids
    assert ngram.token_ids == plain.token_ids
    assert small.stats.tau > 1.5  # the 0.5B sibling agrees with the 1.5B on most code tokens


@pytest.mark.model
@pytest.mark.qwen
def test_a_draft_model_with_another_tokenizer_is_refused():
    from dflash2.drafters import build_drafter

    engine = lean_engine(SMOLLM2, "fp32")
    with pytest.raises(ValueError, match="different tokenizer"):
        build_drafter("model", engine, draft_model=QWEN_DRAFT, dtype="bf16")
    with pytest.raises(ValueError, match="no default draft model"):
        build_drafter("model", engine)
