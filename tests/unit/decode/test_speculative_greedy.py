"""Greedy speculative decoding must reproduce plain greedy decoding token for token (fp32, tiny random models)."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash2.decode.plain import plain_decode
from dflash2.decode.speculative import speculative_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft, Drafter
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from dflash2.verify.sampling import GREEDY
from tests.pipelines import PIPELINES, speculative_steps

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "fp32") for key, path in tiny_model_dirs.items()}


def repetitive_prompt() -> torch.Tensor:
    """A prompt with repeats, so that prompt lookup finds matches."""
    gen = torch.Generator().manual_seed(11)
    motif = torch.randint(0, 256, (6,), generator=gen)
    return torch.cat([motif, torch.randint(0, 256, (5,), generator=gen), motif, motif[:3]])


def run(steps, limit: int) -> list[int]:
    return list(itertools.islice(itertools.chain.from_iterable(steps), limit))


def plain_ids(model, prompt, capacity, limit=NEW_TOKENS):
    return run(plain_decode(model, prompt, GREEDY, None, capacity, DecodeStats()), limit)


@pytest.fixture(params=PIPELINES)
def pipeline(request) -> str:
    """Every lossless test runs through the sync loop and the overlapped pipeline."""
    return request.param


def spec_ids(model, drafter, prompt, capacity, limit=NEW_TOKENS, stats=None, pipeline="sync"):
    stats = stats if stats is not None else DecodeStats()
    return run(speculative_steps(pipeline, model, drafter, prompt, GREEDY, None, capacity, stats), limit)


class RandomDrafter(Drafter):
    """Garbage proposals: nothing should be accepted, output must not change."""

    name = "random"

    def propose(self, sequence, num_draft_tokens, params, generator):
        gen = torch.Generator().manual_seed(len(sequence))
        return Draft(tokens=torch.randint(0, 256, (num_draft_tokens,), generator=gen), q_draft=None)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
@pytest.mark.parametrize("target_key", ["qwen2", "llama"])
def test_model_drafter_equal_to_target_accepts_everything(models, target_key, k, pipeline):
    target, prompt = models[target_key], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    stats = DecodeStats()
    ids = spec_ids(target, ModelDrafter(target, k), prompt, capacity, stats=stats, pipeline=pipeline)
    assert ids == plain_ids(target, prompt, capacity)
    assert stats.accepted_by_position == stats.drafted_by_position  # every draft accepted
    assert stats.target_forwards <= -(-NEW_TOKENS // (k + 1)) + 1


@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
def test_independent_model_drafter_is_lossless(models, k, pipeline):
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    drafter = ModelDrafter(models["qwen2_other"], k)
    assert spec_ids(target, drafter, prompt, capacity, pipeline=pipeline) == plain_ids(target, prompt, capacity)


@pytest.mark.parametrize("k", [1, 2, 4, 8, 15])
def test_ngram_drafter_is_lossless(models, k, pipeline):
    target, prompt = models["llama"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    assert spec_ids(target, NgramDrafter(k), prompt, capacity, pipeline=pipeline) == plain_ids(target, prompt, capacity)


@pytest.mark.parametrize("k", [1, 4, 15])
def test_garbage_drafter_accepts_nothing_and_changes_nothing(models, k, pipeline):
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    stats = DecodeStats()
    ids = spec_ids(target, RandomDrafter(k), prompt, capacity, stats=stats, pipeline=pipeline)
    assert ids == plain_ids(target, prompt, capacity)
    assert sum(stats.accepted_by_position) <= 2  # a random id can match by chance, rarely


@pytest.mark.parametrize("k", [4, 8])
def test_near_the_context_limit_output_ends_exactly_like_plain(models, k, pipeline):
    """Capacity smaller than prompt + k * steps: drafts shrink near the end, nothing overflows."""
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + 13
    expected = plain_ids(target, prompt, capacity, limit=10_000)
    assert len(expected) == 14  # the prefill token + one per remaining slot
    assert spec_ids(target, ModelDrafter(target, k), prompt, capacity, limit=10_000, pipeline=pipeline) == expected
    assert spec_ids(target, NgramDrafter(k), prompt, capacity, limit=10_000, pipeline=pipeline) == expected


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("num_candidates", [2, 4])
def test_ngram_tree_drafts_are_lossless(models, k, num_candidates, pipeline):
    """Several continuations verified at once with tree attention; the accepted branch is compacted in the cache."""
    target, prompt = models["qwen2"], repetitive_prompt()
    drafter = NgramDrafter(k, num_candidates=num_candidates)
    capacity = len(prompt) + NEW_TOKENS + drafter.max_draft_tokens + 1
    stats = DecodeStats()
    ids = spec_ids(target, drafter, prompt, capacity, stats=stats, pipeline=pipeline)
    assert ids == plain_ids(target, prompt, capacity)
    assert stats.target_forwards > 0


def test_tree_verification_accepts_a_branch_other_than_the_first(models, pipeline):
    """A drafter whose first candidate is wrong and second right: the second branch must be accepted."""
    target, prompt = models["llama"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + 16
    expected = plain_ids(target, prompt, capacity)

    class TwoBranches(Drafter):
        name = "two-branches"

        def propose(self, sequence, num_draft_tokens, params, generator):
            done = len(sequence) - len(prompt)
            right = expected[done : done + 3]
            wrong = [(t + 1) % 256 for t in right]
            return Draft(tokens=torch.tensor(wrong + right), q_draft=None, parents=[-1, 0, 1, -1, 3, 4])

    stats = DecodeStats()
    assert spec_ids(target, TwoBranches(3), prompt, capacity, stats=stats, pipeline=pipeline) == expected
    assert stats.accepted_by_position[:3] == stats.drafted_by_position[:3]  # the right branch always wins


def test_tau_counts_every_committed_token_per_target_pass(models):
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + 5
    plain_stats, spec_stats = DecodeStats(), DecodeStats()
    run(plain_decode(target, prompt, GREEDY, None, capacity, plain_stats), NEW_TOKENS)
    assert plain_stats.tau == 1.0 and plain_stats.target_forwards == NEW_TOKENS - 1
    run(speculative_decode(target, ModelDrafter(target, 4), prompt, GREEDY, None, capacity, spec_stats), NEW_TOKENS)
    assert spec_stats.tau == 5.0  # drafter == target: 4 drafts + the bonus every pass


@pytest.mark.parametrize("drafter_key", ["target", "other", "garbage"])
def test_adaptive_draft_length_keeps_output_identical(models, pipeline, drafter_key):
    """Draft lengths chosen per step (including 0 = plain steps once drafts stop paying) change nothing."""
    from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength

    target, prompt = models["qwen2"], repetitive_prompt()
    k_max = 6
    drafter = {"target": lambda: ModelDrafter(target, k_max),
               "other": lambda: ModelDrafter(models["qwen2_other"], k_max),
               "garbage": lambda: RandomDrafter(k_max)}[drafter_key]()
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=k_max, overlap=pipeline == "overlap", probe_interval=4))
    capacity = len(prompt) + NEW_TOKENS + k_max + 1
    stats = DecodeStats()
    steps = speculative_steps(pipeline, target, drafter, prompt, GREEDY, None, capacity, stats, policy)
    assert run(steps, NEW_TOKENS) == plain_ids(target, prompt, capacity)
    if drafter_key == "garbage":  # speculation switched off: few drafts after the first rejections
        assert sum(stats.drafted_by_position) < stats.target_forwards


def test_a_draft_model_reports_the_ids_it_must_read_before_drafting(models):
    """What resuming costs the batch planner: every id committed since the draft model's last pass."""
    target = models["qwen2"]
    drafter = ModelDrafter(target, 2)
    drafter.reset(64)
    sequence = list(range(10, 30))
    assert drafter.unread(sequence) == 20  # nothing read yet (no prefill)
    drafter.propose(sequence, 2, GREEDY, None)
    assert drafter.unread(sequence + [7]) == 1  # only the new pending id
    assert 3 <= drafter.unread(sequence + [7, 8, 9, 10]) <= 4  # steps without drafts (a rejected draft: +1)


def test_the_drafters_read_of_the_prompt_counts_as_drafting_time(models):
    """The draft model's prefill runs after the first token, inside the decode: its seconds are drafter time (a long
    prompt's read costs seconds), not an unexplained part of the decode."""
    import time

    class SlowReader(ModelDrafter):
        def prefill(self, ids, *args, **kwargs):
            time.sleep(0.3)
            return super().prefill(ids, *args, **kwargs)

    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + 8 + 5
    stats = DecodeStats()
    started = time.perf_counter()
    run(speculative_decode(target, SlowReader(target, 2), prompt, GREEDY, None, capacity, stats), 8)
    assert 0.3 <= stats.draft_seconds <= time.perf_counter() - started
