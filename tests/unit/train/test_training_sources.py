"""Training data sources and layout: the synthetic chat prompts, and several shard directories trained as one."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dflash2.models.loading import load_transformer
from dflash2.train.data import ShardSet, TokenShards, TrainingSequence, append_shard, frequent_ids, write_token_shards
from dflash2.train.dflash_trainer import train_dflash
from dflash2.train.prompts import CHAT_TASKS, CHAT_TOPICS, chat_prompts, iter_prompts
from tests.unit.train.test_dflash_training import gsm8k_file, repetitive_data, train_config


def test_chat_prompts_cover_every_task_and_topic_once_in_a_fixed_order():
    prompts = list(chat_prompts())
    assert prompts == list(chat_prompts())  # resumable generation relies on the same stream every run
    assert len(prompts) == len(set(prompts)) == len(CHAT_TASKS) * len(CHAT_TOPICS)
    assert all(p[0].isupper() and "{" not in p for p in prompts)
    first_tasks = [next(i for i, t in enumerate(CHAT_TASKS) if re.fullmatch(
        re.escape(t[0].upper() + t[1:]).replace(re.escape("{topic}"), ".+"), p)) for p in prompts[:8]]
    assert len(set(first_tasks)) > 1  # shuffled: not one task over every topic first


def test_iter_prompts_interleaves_the_chat_source_and_names_the_valid_ones(tmp_path):
    sources = [p.source for _, p in zip(range(6), iter_prompts(("gsm8k", "chat"), gsm8k_file(tmp_path)))]
    assert sources == ["gsm8k", "chat"] * 3
    with pytest.raises(ValueError, match="gsm8k, stdlib, chat"):
        next(iter_prompts(("poetry",)))


def sequences(first: int, count: int) -> list[TrainingSequence]:
    return [TrainingSequence(torch.tensor([9, 9, first + i, first + i, 4]), prompt_length=2) for i in range(count)]


def test_a_shard_set_reads_directories_in_order_and_holds_out_the_tail_of_each(tmp_path):
    a = write_token_shards(tmp_path / "a", sequences(100, 5), shard_size=2)
    b = write_token_shards(tmp_path / "b", sequences(200, 4), shard_size=3)
    shards = ShardSet(f"{a},{b}")
    assert len(shards) == 9 and shards.data_dirs == ShardSet([a, b]).data_dirs
    assert [int(shards[i].ids[2]) for i in range(9)] == [100, 101, 102, 103, 104, 200, 201, 202, 203]
    with pytest.raises(IndexError):
        shards[9]
    train, heldout = shards.split_heldout(3)
    assert heldout == [3, 4, 8] and train == [0, 1, 2, 5, 6, 7]  # 2 from a, 1 from b
    one = ShardSet(a)
    assert one.split_heldout(16) == ([0], [1, 2, 3, 4])  # one sequence always stays for training
    assert one.split_heldout(2) == ([0, 1, 2], [3, 4])  # the single-directory rule: its last sequences
    assert frequent_ids(shards, [5, 6], 2).tolist() == [4, 200]  # only the listed sequences are counted


def test_a_shard_set_refuses_data_of_another_target(tmp_path):
    a = write_token_shards(tmp_path / "a", sequences(100, 2))
    append_shard(tmp_path / "b", sequences(200, 2), settings={"target_model": "other"})
    assert isinstance(TokenShards(tmp_path / "b"), TokenShards)
    with pytest.raises(ValueError, match="different targets"):
        ShardSet([a, tmp_path / "b"])
    with pytest.raises(ValueError, match="no data directory"):
        ShardSet("")


def test_training_reads_several_directories_as_one(tiny_model_dirs, tmp_path):
    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    first, second = repetitive_data(tmp_path / "d1", count=6), repetitive_data(tmp_path / "d2", count=6)
    config = train_config(tmp_path, f"{first},{second}", "run", num_steps=3, heldout_sequences=2)
    final = train_dflash(config, target=target)
    assert (final / "config.json").exists()
    evaluation = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert evaluation["num_blocks"] > 0  # one held-out sequence from each directory was scored


def test_a_warm_start_keeps_or_refreshes_the_draft_vocabulary(tiny_model_dirs, tmp_path):
    from dflash2.drafters.dflash_model import DFlashDraftModel

    target = load_transformer(tiny_model_dirs["qwen2"], "fp32")
    old = write_token_shards(tmp_path / "old", sequences(100, 6), shard_size=3)
    new = write_token_shards(tmp_path / "new", sequences(200, 6), shard_size=3)
    source = train_dflash(train_config(tmp_path, str(old), "source", num_steps=2, draft_vocab_size=8), target=target)
    source_vocab = DFlashDraftModel.from_pretrained(source).draft_vocab

    def warm_start(name: str, **settings) -> torch.Tensor:
        config = train_config(tmp_path, str(new), name, num_steps=2, draft_vocab_size=8, init_from=str(source),
                              **settings)
        return DFlashDraftModel.from_pretrained(train_dflash(config, target=target)).draft_vocab

    assert torch.equal(warm_start("kept"), source_vocab)
    refreshed = warm_start("refreshed", refresh_draft_vocab=True)
    train_ids, _ = ShardSet(str(new)).split_heldout(2)
    assert torch.equal(refreshed.cpu(), frequent_ids(ShardSet(str(new)), train_ids, 8, target.config.eos_token_ids))
    assert 200 in refreshed.tolist() and 200 not in source_vocab.tolist()
    selector = train_dflash(train_config(tmp_path, str(old), "selector", num_steps=1, draft_vocab_size=8,
                                         selector_rank=4, selector_top_k=4), target=target)
    with pytest.raises(ValueError, match="path selector"):
        train_dflash(train_config(tmp_path, str(new), "bad", num_steps=1, draft_vocab_size=8, selector_rank=4,
                                  selector_top_k=4, init_from=str(selector), refresh_draft_vocab=True), target=target)
