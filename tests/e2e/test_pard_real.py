"""The PARD drafter on real weights: greedy identity (fp32) with SmolLM2 as drafter base and target, and with the
Qwen pair (the store's 0.5B, untrained mask embedding or the adapter of a training run, drafting for the 1.5B)."""

from __future__ import annotations

import json
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


def _export_matches_drafter(base_name: str, adapter, tmp_path, dtype: str = "fp32", atol: float = 1e-3):
    """Export (adapter or untrained) -> transformers -> the logits of a draft block equal the drafter's."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash2.models.tokenizer import Tokenizer
    from dflash2.train.pard_export import export_pard

    base = model_dir(base_name, dtype)
    out = export_pard(adapter, base, tmp_path / "hf", dtype, num_draft_tokens=8)
    model, config = load_pard_model(adapter, base, dtype, packed=False, draft_vocab=False)
    drafter = PardDrafter(model, config.mask_token_id, 8)
    drafter.reset(256)
    sequence = Tokenizer(base).encode(CODE_PROMPT)[:64]
    expected = drafter.draft_logits(sequence, 8)
    del drafter, model
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
    with torch.no_grad():
        got = hf.eval()(torch.tensor([sequence + [config.mask_token_id] * 7])).logits[0, len(sequence) - 1 :].float()
    got[:, config.mask_token_id] = float("-inf")
    got = got[:, : expected.shape[-1]]
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.model
def test_smollm2_hf_export_matches_the_drafter(tmp_path):
    """A random adapter (rank 4) on the real SmolLM2 (tied embeddings, Llama layout), exported and reloaded."""
    from tests.unit.drafters.test_pard import write_random_adapter

    base = model_dir(SMOLLM2, "fp32")
    mask_id = default_mask_token_id(json.loads((base / "config.json").read_text())["vocab_size"])
    adapter = write_random_adapter(base, tmp_path / "adapter", mask_id, std=0.01, seed=0)
    _export_matches_drafter(SMOLLM2, adapter, tmp_path)


@pytest.mark.model
@pytest.mark.qwen
@pytest.mark.slow  # the fp32 0.5B twice (4 GB) and a 2 GB export on disk
def test_qwen_hf_export_matches_the_drafter(tmp_path):
    """The shipped adapter (untrained when none is shipped; PARD_ADAPTER=<dir> for another, =untrained for none) on
    the store's 0.5B."""
    from dflash2.drafters.pard import PARD_CONFIG, SHIPPED_DIR
    from dflash2.train.pard_export import shipped_or_given_adapter

    choice = os.environ.get("PARD_ADAPTER", "")
    if not choice and not (SHIPPED_DIR / f"{QWEN_TARGET}-pard" / PARD_CONFIG).exists():
        choice = "untrained"
    _export_matches_drafter(QWEN_DRAFT, shipped_or_given_adapter(choice, QWEN_TARGET), tmp_path)
