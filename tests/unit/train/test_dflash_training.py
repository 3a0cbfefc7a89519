"""DFlash training: resumable data generation, block construction and loss weights, learning, exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash2.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from dflash2.models.loading import load_transformer
from dflash2.train.data import (
    DataConfig,
    TokenShards,
    TrainingSequence,
    generate_training_data,
    greedy_response,
    iter_prompts,
    read_manifest,
    write_token_shards,
)
from dflash2.train.dflash_trainer import TrainConfig, latest_checkpoint, train_dflash
from dflash2.train.evaluate import evaluate_acceptance, target_pass
from dflash2.train.objective import block_hidden, build_anchor_batch, default_gamma, position_weights, sample_anchors

MASK = 255


@pytest.fixture(scope="module")
def target(tiny_model_dirs):
    return load_transformer(tiny_model_dirs["qwen2"], "fp32")


def byte_encoder(text: str) -> list[int]:
    return list(text.encode("utf-8"))[:24]


def test_position_weights_skip_position_zero_and_decay():
    weights = position_weights(8, 4.0)
    assert weights[0] == 0.0 and weights[1] == 1.0
    assert torch.allclose(weights[2:], torch.exp(-torch.arange(1, 7) / 4.0))
    assert default_gamma(8) == 4.0 and default_gamma(16) == 7.0


def test_anchor_batch_blocks_targets_and_mask():
    ids = torch.arange(100, 120)  # N = 20
    anchors = torch.tensor([5, 9, 18])
    weights = position_weights(4, 4.0)
    batch = build_anchor_batch(ids, anchors, 4, MASK, weights)
    assert batch.input_ids.tolist() == [105, MASK, MASK, MASK, 109, MASK, MASK, MASK, 118, MASK, MASK, MASK]
    assert batch.positions.tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 18, 19, 20, 21]
    assert batch.labels[[1, 2, 3, 5, 6, 7, 9]].tolist() == [106, 107, 108, 110, 111, 112, 119]
    assert batch.weights.view(3, 4)[:, 0].eq(0).all()  # position 0: no loss
    assert batch.weights[[10, 11]].eq(0).all()  # past the end of the sequence: no loss
    assert torch.allclose(batch.weights[[1, 2, 3]], weights[1:])
    assert batch.context_length == 18
    mask = batch.attn_mask[0]  # [12, 18 + 12]
    context, blocks = mask[:, :18], mask[:, 18:]
    assert context[0:4].sum(-1).eq(5).all() and context[0:4, :5].all()  # block 0 sees positions 0..4
    assert context[4:8].sum(-1).eq(9).all() and context[8:12].sum(-1).eq(18).all()
    expected_blocks = torch.block_diag(*[torch.ones(4, 4, dtype=torch.bool)] * 3)
    assert torch.equal(blocks, expected_blocks)  # bidirectional within a block, blind across blocks


def test_anchors_lie_in_the_response():
    generator = torch.Generator().manual_seed(0)
    anchors = sample_anchors(prompt_length=6, length=20, count=50, generator=generator)
    assert anchors.tolist() == list(range(6, 19))  # all candidates, sorted and distinct
    few = sample_anchors(6, 20, 4, generator)
    assert len(few) == 4 and few.unique().numel() == 4 and few.min() >= 6 and few.max() <= 18
    assert sample_anchors(6, 7, 4, generator).numel() == 0  # a one-token response has nothing to predict


def test_batched_training_blocks_equal_the_drafter_at_inference(target):
    """One masked forward over many blocks gives what the drafter computes for each block at decode time."""
    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashConfig.for_target(target.config, num_layers=2, block_size=8)).eval()
    ids = torch.randint(0, 250, (30,), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([7, 12, 13, 25])
    batch = build_anchor_batch(ids, anchors, 8, model.config.mask_token_id, position_weights(8, 4.0))
    with torch.no_grad():
        taps = target_pass(target, ids, model.config.target_layer_ids).hidden_states
        batched = model.logits(target, block_hidden(model, target, taps, batch)).view(4, 8, -1)
    drafter = DFlashDrafter(model, target)
    for row, anchor in enumerate(anchors.tolist()):
        drafter.reset(64)
        drafter.observe(ids[: anchor + 1].tolist(), -1, tuple(t[:, :anchor] for t in taps))
        with torch.inference_mode():
            single = drafter.block_logits(int(ids[anchor]), anchor)
        assert torch.allclose(batched[row], single, atol=1e-4), anchor


def gsm8k_file(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    questions = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]
    path.write_text("".join(json.dumps({"question": q, "answer": "x"}) + "\n" for q in questions))
    return str(path)


def all_sequences(directory) -> list[tuple[list[int], int]]:
    return [(s.ids.tolist(), s.prompt_length) for s in TokenShards(directory)]


def test_data_generation_writes_shards_and_resumes_without_duplicates(target, tmp_path):
    gsm8k = gsm8k_file(tmp_path)
    settings = dict(max_new_tokens=6, shard_size=2, gsm8k_path=gsm8k, progress=False)
    partial = tmp_path / "partial"
    generate_training_data(DataConfig(str(partial), num_sequences=3, **settings), target, byte_encoder, stop_ids=())
    manifest = read_manifest(partial)
    assert manifest["num_sequences"] == 3 and manifest["prompts_done"] == 3 and len(manifest["shards"]) == 2
    generate_training_data(DataConfig(str(partial), num_sequences=5, **settings), target, byte_encoder, stop_ids=())
    generate_training_data(DataConfig(str(partial), num_sequences=5, **settings), target, byte_encoder, stop_ids=())
    whole = tmp_path / "whole"
    generate_training_data(DataConfig(str(whole), num_sequences=5, **settings), target, byte_encoder, stop_ids=())
    assert all_sequences(partial) == all_sequences(whole)
    assert read_manifest(partial)["prompts_done"] == 5

    prompts = [p for _, p in zip(range(5), iter_prompts(("gsm8k", "stdlib"), gsm8k))]
    assert [p.source for p in prompts] == ["gsm8k", "stdlib", "gsm8k", "stdlib", "gsm8k"]
    for (ids, prompt_length), prompt in zip(all_sequences(partial), prompts):  # prompt + greedy response, in order
        expected_prompt = byte_encoder(prompt.text)
        assert ids[:prompt_length] == expected_prompt
        assert ids[prompt_length:] == greedy_response(target, expected_prompt, 6, ())
    crashing = tmp_path / "crashing"
    calls = []

    def crash_on_the_fourth_prompt(text):
        calls.append(text)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return byte_encoder(text)

    with pytest.raises(KeyboardInterrupt):
        generate_training_data(DataConfig(str(crashing), num_sequences=5, **dict(settings, shard_size=10)), target,
                               crash_on_the_fourth_prompt, stop_ids=())
    assert read_manifest(crashing)["num_sequences"] == 3  # what was generated before the crash is kept
    generate_training_data(DataConfig(str(crashing), num_sequences=5, **dict(settings, shard_size=10)), target,
                           byte_encoder, stop_ids=())
    assert all_sequences(crashing) == all_sequences(whole)
    with pytest.raises(ValueError, match="other settings"):
        generate_training_data(DataConfig(str(partial), num_sequences=6, **dict(settings, max_new_tokens=7)),
                               target, byte_encoder)


def test_a_keyboard_interrupt_keeps_the_last_completed_step(target, tmp_path, monkeypatch):
    import dflash2.train.dflash_trainer as trainer

    data = repetitive_data(tmp_path / "data")
    whole = train_dflash(train_config(tmp_path, data, "whole"), target=target)
    calls = []
    original = trainer.block_loss

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 9:  # the first sequence of step 5 (2 sequences per step)
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(trainer, "block_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_dflash(train_config(tmp_path, data, "split"), target=target)
    assert latest_checkpoint(tmp_path / "split").name == "step_0000004"
    monkeypatch.setattr(trainer, "block_loss", original)
    assert same_weights(whole, train_dflash(train_config(tmp_path, data, "split"), target=target))


def repetitive_data(directory, count: int = 12) -> str:
    """Prompts of random ids followed by a motif repeated: a block drafter can learn it quickly."""
    generator = torch.Generator().manual_seed(0)
    motif = torch.tensor([11, 42, 7, 99, 3])
    sequences = []
    for _ in range(count):
        prompt = torch.randint(0, 250, (4,), generator=generator)
        shift = int(torch.randint(0, 5, (1,), generator=generator))
        sequences.append(TrainingSequence(ids=torch.cat([prompt, motif.roll(shift).repeat(7)]), prompt_length=4))
    write_token_shards(directory, sequences, shard_size=5)
    return str(directory)


def train_config(tmp_path, data_dir, name: str, **overrides) -> TrainConfig:
    settings = dict(target_dir="unused", data_dir=data_dir, out_dir=str(tmp_path / name), target_dtype="fp32",
                    num_layers=1, block_size=8, anchors_per_sequence=8, sequences_per_step=2, num_steps=6,
                    learning_rate=3e-3, warmup_steps=2, heldout_sequences=2, checkpoint_every=100, eval_anchors=4,
                    progress=False)
    settings.update(overrides)
    return TrainConfig(**settings)


def test_a_few_steps_lower_the_loss(target, tmp_path):
    data = repetitive_data(tmp_path / "data")
    config = train_config(tmp_path, data, "run", num_steps=40, learning_rate=2e-2, warmup_steps=3,
                          anchors_per_sequence=32)
    final = train_dflash(config, target=target)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(losses) == 40
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    evaluation = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert evaluation["tau"] >= 1.0 and len(evaluation["acceptance_by_position"]) == 7
    assert math.isfinite(evaluation["loss"])


def same_weights(a_dir, b_dir) -> bool:
    a = DFlashDraftModel.from_pretrained(a_dir).state_dict()
    b = DFlashDraftModel.from_pretrained(b_dir).state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stopped_and_resumed_training_equals_an_uninterrupted_run(target, tmp_path):
    data = repetitive_data(tmp_path / "data")
    whole = train_dflash(train_config(tmp_path, data, "whole"), target=target)
    stopped = train_dflash(train_config(tmp_path, data, "split", stop_at_step=3), target=target)
    assert latest_checkpoint(tmp_path / "split").name == "step_0000003" and stopped.parent.name == "step_0000003"
    resumed = train_dflash(train_config(tmp_path, data, "split"), target=target)
    assert len((tmp_path / "split" / "train_log.jsonl").read_text().splitlines()) == 6  # 3 + 3: it resumed
    assert same_weights(whole, resumed)
    assert not same_weights(whole, stopped)
    with pytest.raises(ValueError, match="different training recipe"):
        train_dflash(train_config(tmp_path, data, "split", learning_rate=1e-3, num_steps=8), target=target)


class ForcedDrafts(DFlashDraftModel):
    """Its head output is fixed by the test: ``forced`` [Q, V]."""

    forced: torch.Tensor

    def logits(self, target, hidden):
        return self.forced


def test_acceptance_check_counts_leading_matches(target):
    torch.manual_seed(0)
    model = ForcedDrafts(DFlashConfig.for_target(target.config, num_layers=1, block_size=4))
    prompt = [1, 2, 3, 4]
    ids = torch.tensor(prompt + greedy_response(target, prompt, 12, ()))  # the target's own continuation
    anchors = torch.linspace(4, len(ids) - 4, steps=5).round().long()  # what the check picks for 5 blocks
    truth = ids[(anchors[:, None] + torch.arange(4)).clamp(max=len(ids) - 1)]  # [5, 4] ids[a + j]
    drafts = torch.where(torch.arange(4) <= 2, truth, (truth + 1) % 256)  # drafts 1 and 2 right, draft 3 wrong
    model.forced = torch.nn.functional.one_hot(drafts.reshape(-1), 256).float() * 10
    result = evaluate_acceptance(model, target, [TrainingSequence(ids=ids, prompt_length=4)], anchors_per_sequence=5)
    assert result.num_blocks == 5
    assert result.tau == pytest.approx(3.0)  # 2 accepted + the bonus
    assert result.acceptance_by_position == [1.0, 1.0, 0.0]


def test_end_to_end_a_trained_drafter_is_accepted_and_lossless(tiny_model_dirs, tmp_path):
    """Generate data with the target, train briefly, decode the held-out prompt: drafts accepted, output unchanged.

    (The tiny random target falls into repeating one token, which a drafter learns in a few steps.)
    """
    import itertools

    from dflash2.decode.plain import plain_decode
    from dflash2.decode.speculative import speculative_decode
    from dflash2.decode.stats import DecodeStats
    from dflash2.drafters.dflash import load_dflash_drafter
    from dflash2.train.data import Prompt
    from dflash2.verify.sampling import GREEDY

    target = load_transformer(tiny_model_dirs["llama"], "fp32")
    prompts = [Prompt("test", f"prompt number {i} says hello") for i in range(8)]
    data = generate_training_data(DataConfig(str(tmp_path / "data"), num_sequences=8, max_new_tokens=24,
                                             sources=("test",), progress=False),
                                  target, byte_encoder, stop_ids=(), prompts=prompts)
    config = train_config(tmp_path, str(data), "run", num_steps=30, learning_rate=2e-2, warmup_steps=3,
                          anchors_per_sequence=16, heldout_sequences=1)
    drafter = load_dflash_drafter(train_dflash(config, target=target), target)
    evaluation = json.loads((tmp_path / "run" / "eval.jsonl").read_text().splitlines()[-1])
    assert evaluation["tau"] > 2.0

    heldout = torch.tensor(byte_encoder(prompts[-1].text))
    capacity = len(heldout) + 40 + 8
    stats = DecodeStats()
    speculative = speculative_decode(target, drafter, heldout, GREEDY, None, capacity, stats)
    plain = plain_decode(target, heldout, GREEDY, None, capacity, DecodeStats())
    first_40 = [list(itertools.islice(itertools.chain.from_iterable(steps), 40)) for steps in (speculative, plain)]
    assert first_40[0] == first_40[1]
    assert sum(stats.accepted_by_position) > 10


def test_greedy_response_through_a_drafter_equals_plain(target):
    """Data generation may use lossless speculative decoding: the stored ids must not change."""
    from dflash2.drafters.ngram import NgramDrafter

    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = greedy_response(target, prompt, 30, stop_ids=())
    assert len(plain) == 30
    assert greedy_response(target, prompt, 30, stop_ids=(), drafter=NgramDrafter(4)) == plain
    stop = {plain[10]}
    assert greedy_response(target, prompt, 30, stop, NgramDrafter(4)) == greedy_response(target, prompt, 30, stop)
