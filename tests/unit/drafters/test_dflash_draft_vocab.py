"""DFlash drafter options: a reduced draft vocabulary for the head, and packed bf16 projections."""

from __future__ import annotations

import pytest
import torch

from dflash2.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter, load_dflash_drafter
from dflash2.kernels import PackedLinear
from dflash2.models.loading import load_transformer
from dflash2.train.data import TokenShards, TrainingSequence, frequent_ids, write_token_shards
from dflash2.train.evaluate import evaluate_acceptance
from dflash2.train.objective import block_loss, build_anchor_batch, position_weights
from dflash2.verify.sampling import SamplingParams
from tests.unit.drafters.test_dflash_drafter import NEW_TOKENS, first_draft, make_model, plain_ids, prompt_ids, spec_ids

VOCAB = torch.tensor([7, 3, 200, 11, 42, 99, 5, 0, 1, 2])  # most frequent first


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32")


def vocab_model(target, block_size: int = 8) -> DFlashDraftModel:
    model = make_model(target, block_size, draft_vocab_size=len(VOCAB))
    model.set_draft_vocab(VOCAB)
    return model


def test_logits_outside_the_draft_vocabulary_are_minus_infinity(target):
    model, full = vocab_model(target), make_model(target, 8)
    hidden = torch.randn(3, target.config.hidden_size)
    logits = model.logits(target, hidden)  # [3, V]
    assert logits.shape == (3, target.config.vocab_size)
    outside = torch.ones(target.config.vocab_size, dtype=torch.bool)
    outside[VOCAB] = False
    assert torch.isneginf(logits[:, outside]).all()
    torch.testing.assert_close(logits[:, VOCAB], full.logits(target, hidden)[:, VOCAB])  # same head rows
    assert model.draft_labels(torch.tensor([200, 6, 7])).tolist() == [2, -1, 0]


def test_draft_vocabulary_is_validated(target):
    model = make_model(target, 8, draft_vocab_size=4)
    with pytest.raises(ValueError, match="distinct"):
        model.set_draft_vocab(torch.tensor([1, 1, 2, 3]))
    with pytest.raises(ValueError, match="outside"):
        model.set_draft_vocab(torch.tensor([1, 2, 3, target.config.vocab_size]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DFlashConfig.for_target(target.config, draft_vocab_size=target.config.vocab_size + 1)


def test_greedy_and_sampled_decoding_stay_lossless_with_a_draft_vocabulary(target):
    prompt, capacity = prompt_ids(), len(prompt_ids()) + NEW_TOKENS + 8
    drafter = DFlashDrafter(vocab_model(target), target)
    assert spec_ids(target, drafter, prompt, capacity) == plain_ids(target, prompt, capacity)
    draft = first_draft(drafter, target, prompt, capacity, SamplingParams(temperature=0.9))
    assert set(draft.tokens.tolist()) <= set(VOCAB.tolist())
    assert torch.allclose(draft.q_draft.sum(-1), torch.ones(5))
    assert float(draft.q_draft[:, [i for i in range(256) if i not in VOCAB.tolist()]].sum()) == 0.0


def test_save_load_keeps_the_draft_vocabulary(target, tmp_path):
    model = vocab_model(target)
    loaded = DFlashDraftModel.from_pretrained(model.save_pretrained(tmp_path / "d"))
    assert loaded.config.draft_vocab_size == len(VOCAB) and loaded.draft_vocab.tolist() == VOCAB.tolist()
    hidden = torch.randn(2, target.config.hidden_size)
    torch.testing.assert_close(loaded.logits(target, hidden), model.logits(target, hidden))


def test_frequent_ids_rank_response_tokens_and_keep_stop_ids(tmp_path):
    sequences = [TrainingSequence(torch.tensor([9, 9, 9, 5, 5, 4, 4, 4, 1]), prompt_length=3),
                 TrainingSequence(torch.tensor([8, 5, 4, 2]), prompt_length=1)]
    shards = TokenShards(write_token_shards(tmp_path / "data", sequences))
    assert frequent_ids(shards, 2, 3).tolist() == [4, 5, 1]  # 9 is prompt only; 1 and 2 tie: smaller id first
    assert frequent_ids(shards, 2, 3, always=(250,)).tolist() == [250, 4, 5]
    assert frequent_ids(shards, 1, 2).tolist() == [4, 5]


def test_the_training_loss_ignores_labels_outside_the_draft_vocabulary(target):
    model = vocab_model(target).train()
    ids = torch.tensor([1, 2, 3, 7, 3, 6, 6, 6, 200, 11, 42, 6])
    batch = build_anchor_batch(ids, torch.tensor([3, 6]), 8, model.config.mask_token_id, position_weights(8, 4.0))
    taps = tuple(target(ids[None], hidden_layers=model.config.target_layer_ids, logits="none").hidden_states)
    loss = block_loss(model, target, taps, batch)
    loss.backward()
    assert torch.isfinite(loss) and model.fc.weight.grad is not None


def test_the_held_out_loss_ignores_labels_outside_the_draft_vocabulary(target):
    model = vocab_model(target)
    ids = torch.tensor([1, 2, 3, 7, 3, 6, 6, 6, 200, 11, 42, 6, 7, 3, 200, 6, 6, 11])  # 6 is outside VOCAB
    result = evaluate_acceptance(model, target, [TrainingSequence(ids=ids, prompt_length=3)], anchors_per_sequence=4)
    assert result.num_blocks > 0 and torch.isfinite(torch.tensor(result.loss)) and result.loss > 0


def test_packed_bf16_drafter_matches_its_unpacked_self(tmp_path):
    from tests.conftest import make_hf_model

    make_hf_model("qwen2", 0).save_pretrained(str(tmp_path / "t"))
    target = load_transformer(tmp_path / "t", "bf16")  # packed target on a CPU
    model = make_model(load_transformer(tmp_path / "t", "fp32"), 8, draft_vocab_size=len(VOCAB))
    model.set_draft_vocab(VOCAB)
    directory = model.save_pretrained(tmp_path / "d")
    packed = load_dflash_drafter(directory, target)
    plain = DFlashDrafter(DFlashDraftModel.from_pretrained(directory, "bf16"), target)
    assert isinstance(packed.model.layers[0].attn.wqkv, PackedLinear) and isinstance(packed.model.fc, PackedLinear)
    prompt, capacity = prompt_ids(), len(prompt_ids()) + 16
    for drafter in (packed, plain):
        drafter.reset(capacity)
        with torch.inference_mode():
            out = target(prompt[None], hidden_layers=drafter.hidden_layers, logits="last")
            drafter.observe(prompt.tolist() + [5], -1, out.hidden_states)
    with torch.inference_mode():
        a, b = packed.block_logits(5, len(prompt)), plain.block_logits(5, len(prompt))
    torch.testing.assert_close(a[:, VOCAB], b[:, VOCAB], atol=0.1, rtol=0.05)  # bf16 rounding only
    assert spec_ids(target, packed, prompt, capacity, limit=8) == plain_ids(target, prompt, capacity, limit=8)
