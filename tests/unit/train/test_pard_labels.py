"""Soft labels from teacher-forced target passes: shard format, exact top-k, resume without duplicates."""

from __future__ import annotations

import torch

from dflash2.models.loading import load_transformer
from dflash2.train.data import TrainingSequence, write_token_shards
from dflash2.train.labels import (LabelConfig, LabelItem, LabelShards, clean_gsm8k_answer, generate_labels,
                                  label_items, label_sequence, read_manifest)


def regen_dir(tmp_path, count=7):
    gen = torch.Generator().manual_seed(3)
    sequences = [TrainingSequence(torch.randint(0, 255, (int(torch.randint(8, 30, (1,), generator=gen)),),
                                                generator=gen), prompt_length=4 + i % 3) for i in range(count)]
    return write_token_shards(tmp_path / "regen", sequences, shard_size=3), sequences


def test_label_sequence_matches_the_full_distribution(tiny_model_dirs):
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    ids = list(range(10, 30))
    labelled = label_sequence(target, LabelItem(0, ids, label_start=5), top_k=8, logit_rows=4)
    probs = torch.softmax(target(torch.tensor([ids])).logits[0], dim=-1)[5:-1]  # [N - 1 - 5, V]
    values, indices = probs.topk(8, dim=-1)
    assert labelled.topk_ids.shape == (len(ids) - 6, 8)
    assert torch.equal(labelled.topk_ids.long(), indices)
    torch.testing.assert_close(labelled.topk_probs.float(), values, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(labelled.rest.float(), 1 - values.sum(-1), atol=1e-3, rtol=1e-3)


def test_regen_items_label_the_responses(tmp_path):
    directory, sequences = regen_dir(tmp_path)
    items = list(label_items([f"regen:{directory}"], tokenizer=None))
    assert [item.ids for item in items] == [s.ids.tolist() for s in sequences]
    assert [item.label_start for item in items] == [s.prompt_length - 1 for s in sequences]


def test_sources_interleave_round_robin(tmp_path):
    directory, sequences = regen_dir(tmp_path, count=2)
    other, _ = regen_dir(tmp_path / "b", count=4)
    items = list(label_items([f"regen:{directory}", f"regen:{other}"], tokenizer=None))
    assert [item.source for item in items] == [0, 1, 0, 1, 1, 1]


def test_labels_resume_without_duplicates(tmp_path, tiny_model_dirs):
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    directory, sequences = regen_dir(tmp_path)
    sources = (f"regen:{directory}",)
    split = tmp_path / "split"
    generate_labels(LabelConfig(str(split), sources, top_k=4, max_items=3, shard_tokens=40, progress=False),
                    target, None)
    assert read_manifest(split)["items_done"] == 3
    generate_labels(LabelConfig(str(split), sources, top_k=4, shard_tokens=40, progress=False), target, None)
    whole = tmp_path / "whole"
    generate_labels(LabelConfig(str(whole), sources, top_k=4, shard_tokens=1000, progress=False), target, None)
    a, b = LabelShards(split), LabelShards(whole)
    assert len(a) == len(b) == len(sequences)
    assert len(a.entries) > len(b.entries)  # several shards, read as one list
    for x, y, s in zip(a, b, sequences):
        assert torch.equal(x.ids, s.ids) and torch.equal(x.ids, y.ids)
        assert x.label_start == s.prompt_length - 1
        assert x.topk_ids.shape == (len(s.ids) - s.prompt_length, 4)
        assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_probs, y.topk_probs)
    manifest = read_manifest(split)
    assert manifest["num_tokens"] == sum(len(s.ids) for s in sequences)
    assert manifest["num_rows"] == sum(len(s.ids) - s.prompt_length for s in sequences)


def test_other_settings_are_refused(tmp_path, tiny_model_dirs):
    import pytest

    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    directory, _ = regen_dir(tmp_path)
    out = str(tmp_path / "labels")
    generate_labels(LabelConfig(out, (f"regen:{directory}",), top_k=4, max_items=1, progress=False), target, None)
    with pytest.raises(ValueError, match="other settings"):
        generate_labels(LabelConfig(out, (f"regen:{directory}",), top_k=8, progress=False), target, None)


def test_gsm8k_answers_are_cleaned():
    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"
    assert clean_gsm8k_answer(answer) == "Natalia sold 48/2 = 24 clips in May.\nIn all 48+24 = 72.\nThe answer is 72."


def test_a_draft_vocabulary_rewritten_from_the_same_data_keeps_its_bytes(tmp_path):
    from dflash2.drafters.pard import DRAFT_VOCAB_FILE, PardConfig
    from dflash2.train.pard_trainer import write_draft_vocab

    regen, _ = regen_dir(tmp_path, count=9)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    PardConfig(base_model="tiny", mask_token_id=300, num_draft_tokens=4, lora_rank=4, lora_alpha=8.0).save(adapter)
    written = set()
    for _ in range(12):  # (its two metadata keys came out in either order before they were sorted)
        written.add(write_draft_vocab(adapter, str(regen), 32, heldout_sequences=2).read_bytes())
    assert len(written) == 1
    assert sorted(p.name for p in adapter.iterdir()) == [DRAFT_VOCAB_FILE, "pard_config.json"]
