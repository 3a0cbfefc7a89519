"""Batched greedy data generation: same ids as batch-1 greedy, hidden states equal to a target forward."""

from __future__ import annotations

import json

import pytest
import torch

from dflash2.models.loading import load_transformer
from dflash2.train.batched import batched_greedy
from dflash2.train.data import (DataConfig, TokenShards, fill_missing_hidden, generate_training_data, greedy_response,
                                read_manifest, shards_missing_hidden)
from dflash2.train.evaluate import sequence_taps, target_pass

LAYERS = (0, 2)


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32")


def test_batched_greedy_matches_batch_one_greedy_and_target_hidden_states(target):
    prompts = [[5, 9, 11, 3, 7, 1, 2], [17], [40, 41, 42, 43], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]
    single = [greedy_response(target, p, 12, ()) for p in prompts]
    stop = {single[2][4]}  # makes row 2 (and any row producing that id) stop early
    expected = [greedy_response(target, p, 12, stop) for p in prompts]
    assert len(expected[2]) <= 5 and expected[2][-1] in stop  # rows of several lengths in one batch
    outputs = batched_greedy(target, prompts, 12, stop, hidden_layers=LAYERS)
    for prompt, want, got in zip(prompts, expected, outputs):
        assert got.response == want
        ids = torch.tensor(prompt + got.response)
        reference = target_pass(target, ids[:-1], LAYERS).hidden_states  # one [1, N - 1, D] per layer
        assert got.hidden.shape == (len(ids) - 1, len(LAYERS), target.config.hidden_size)
        for tap, layer_hidden in enumerate(reference):
            torch.testing.assert_close(got.hidden[:, tap], layer_hidden[0], atol=2e-4, rtol=1e-4)


def test_batched_greedy_refuses_empty_prompts(target):
    with pytest.raises(ValueError, match="empty"):
        batched_greedy(target, [[1, 2], []], 4, ())


def test_batched_data_generation_stores_hidden_states_the_trainer_reads(target, tmp_path):
    gsm8k = tmp_path / "gsm8k.jsonl"
    gsm8k.write_text("".join(json.dumps({"question": f"What is {i} times {i + 3}?"}) + "\n" for i in range(8)))
    encode = lambda text: list(text.encode("utf-8"))[:20]  # noqa: E731
    common = dict(max_new_tokens=6, gsm8k_path=str(gsm8k), sources=("gsm8k",), progress=False)
    batched = DataConfig(str(tmp_path / "batched"), 5, shard_size=2, batch_size=3, hidden_layers=LAYERS,
                         hidden_dir=str(tmp_path / "elsewhere"), **common)
    single = DataConfig(str(tmp_path / "single"), 5, shard_size=4, **common)
    generate_training_data(batched, target, encode, stop_ids=())
    generate_training_data(single, target, encode, stop_ids=())
    assert read_manifest(batched.out_dir)["settings"]["hidden_layers"] == list(LAYERS)
    stored, plain = TokenShards(batched.out_dir), TokenShards(single.out_dir)
    assert stored.hidden_layers == LAYERS and plain.hidden_layers == ()
    assert [s.ids.tolist() for s in stored] == [s.ids.tolist() for s in plain]
    for sequence in stored:
        from_data = sequence_taps(target, sequence, stored.hidden_layers, (2,))
        computed = target_pass(target, sequence.ids, (2,)).hidden_states
        assert from_data[0].shape[1] == len(sequence.ids) - 1
        torch.testing.assert_close(from_data[0], computed[0][:, :-1], atol=2e-4, rtol=1e-4)
    assert sequence_taps(target, stored[0], stored.hidden_layers, (1,))[0].shape[1] == len(stored[0].ids)
    assert len(list((tmp_path / "elsewhere").glob("shard_*.safetensors"))) == 3  # outside the data directory
    (tmp_path / "elsewhere" / "shard_00000.safetensors").unlink()  # e.g. a fresh clone on another machine
    fresh = TokenShards(batched.out_dir)
    assert fresh[0].hidden is None and fresh[4].hidden is not None  # missing files: the trainer recomputes
    assert shards_missing_hidden(batched.out_dir) == [0] and shards_missing_hidden(single.out_dir) == []
    assert fill_missing_hidden(batched.out_dir, target, progress=False) == 1  # ... or `dflash2 train hidden` does once
    assert shards_missing_hidden(batched.out_dir) == [] and fill_missing_hidden(batched.out_dir, target) == 0
    filled = TokenShards(batched.out_dir)
    for index in (0, 1):  # shard 0, rewritten where the manifest says
        assert filled[index].hidden.shape == (len(filled[index].ids) - 1, len(LAYERS), target.config.hidden_size)
        torch.testing.assert_close(filled[index].hidden, target_pass_taps(target, filled[index].ids))
    assert (tmp_path / "elsewhere" / "shard_00000.safetensors").exists()


def target_pass_taps(target, ids: torch.Tensor) -> torch.Tensor:
    """[N - 1, taps, D]: the stored layout of the hidden states of ``ids`` (the last id's are never needed)."""
    return torch.stack(target_pass(target, ids, LAYERS).hidden_states, dim=2)[0, :-1]


def test_batched_greedy_refuses_to_run_past_the_context(target):
    context = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        batched_greedy(target, [[1] * 8, [2]], context - 7, ())
