"""The PARD drafter on real weights: greedy identity (fp32) with SmolLM2 as drafter base and target, and with the
Qwen pair (the store's 0.5B, untrained mask embedding or the adapter of a training run, drafting for the 1.5B)."""

from __future__ import annotations

import os

import pytest

from dflash2.drafters import DraftTarget
from dflash2.drafters.pard import PardDrafter, build_pard_drafter, default_mask_token_id, load_pard_model
from tests.e2e.conftest import QWEN_DRAFT, QWEN_TARGET, SMOLLM2, lean_engine, model_dir
from tests.e2e.test_speculative_real import CODE_PROMPT, generate_with, plain_result


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 4, 8])
def test_smollm2_pard_drafting_for_itself_is_lossless(k):
    engine = lean_engine(SMOLLM2, "fp32")
    # a store model as --draft-model: the untrained network (mask embedding = the mean embedding)
    drafter = build_pard_drafter(DraftTarget(engine.target, engine.tokenizer, SMOLLM2), SMOLLM2, k, dtype="fp32")
    assert drafter.num_draft_tokens == k
    spec = generate_with(engine, drafter, CODE_PROMPT, max_new_tokens=64)
    assert spec.token_ids == plain_result(SMOLLM2, CODE_PROMPT, 64).token_ids
    # draft 1 is the network's own next token: always accepted when it drafts for itself
    assert spec.stats.accepted_by_position[0] == spec.stats.drafted_by_position[0]


@pytest.mark.model
@pytest.mark.qwen
@pytest.mark.slow  # two fp32 Qwen models (8 GB): the SmolLM2 tests above keep the default run's check
def test_qwen_pard_is_lossless():
    """PARD_ADAPTER=<run>/drafter tests a trained adapter; without it the untrained mask embedding drafts."""
    engine = lean_engine(QWEN_TARGET, "fp32")
    adapter = os.environ.get("PARD_ADAPTER")
    model, config = load_pard_model(adapter, model_dir(QWEN_DRAFT, "fp32"), "fp32")
    assert config.mask_token_id == default_mask_token_id(model.config.vocab_size)
    drafter = PardDrafter(model, config.mask_token_id, 8, target_vocab_size=engine.target.config.vocab_size)
    spec = generate_with(engine, drafter, CODE_PROMPT, max_new_tokens=48)
    assert spec.token_ids == plain_result(QWEN_TARGET, CODE_PROMPT, 48).token_ids
    assert spec.stats.accepted_by_position[0] > 0
