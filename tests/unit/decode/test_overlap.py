"""The overlapped pipeline: forced pre-draft hits and misses keep greedy output identical to plain decoding (fp32),
the drafter's state is repaired after a miss, DFlash drafts ahead, seeded sampling is reproducible."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash2.decode.overlap import SpeculationCache, overlap_decode
from dflash2.decode.plain import plain_decode
from dflash2.decode.step import StepOutcome
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft
from dflash2.drafters.dflash import DFlashConfig, DFlashDraftModel, DFlashDrafter
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from dflash2.verify.sampling import GREEDY, SamplingParams
from tests.pipelines import shared_worker

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "fp32") for key, path in tiny_model_dirs.items()}


def prompt_ids(seed: int = 11) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 256, (6,), generator=gen)
    return torch.cat([motif, torch.randint(0, 256, (5,), generator=gen), motif, motif[:3]])


def run(steps, limit: int = NEW_TOKENS) -> list[int]:
    """The first ``limit`` tokens; then the generator is closed (the pipeline waits for its drafter)."""
    ids = list(itertools.islice(itertools.chain.from_iterable(steps), limit))
    steps.close()
    return ids


def plain_ids(target, prompt, capacity, limit: int = NEW_TOKENS) -> list[int]:
    return run(plain_decode(target, prompt, GREEDY, None, capacity, DecodeStats()), limit)


def overlap_ids(target, drafter, prompt, capacity, stats, params=GREEDY, generator=None) -> list[int]:
    return run(overlap_decode(target, drafter, prompt, params, generator, capacity, stats, shared_worker()))


class MissingDrafter(ModelDrafter):
    """Pre-drafts from a corrupted block (filling its cache with tokens that never get committed) and reports an
    impossible bonus guess: every pre-draft misses, and the next propose must roll the cache back."""

    def propose_ahead(self, sequence, block, num_draft_tokens, params, generator):
        corrupted = block[:-1] + [(block[-1] + 1) % self.target_vocab_size]
        draft = super().propose_ahead(sequence, corrupted, num_draft_tokens, params, generator)
        tokens = draft.tokens.clone()
        tokens[0] = -1  # no token id: the outcome can never match
        return Draft(tokens=tokens, q_draft=draft.q_draft)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_forced_hits_identical_output_and_every_predraft_used(models, k):
    """The drafter is the target: every block is accepted and every bonus guessed."""
    target, prompt = models["qwen2"], prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    stats = DecodeStats()
    assert overlap_ids(target, ModelDrafter(target, k), prompt, capacity, stats) == plain_ids(target, prompt, capacity)
    assert stats.predrafts > 0 and stats.predraft_hits == stats.predrafts
    assert stats.accepted_by_position == stats.drafted_by_position


@pytest.mark.parametrize("k", [1, 4, 8])
def test_forced_misses_roll_the_drafter_back(models, k):
    """Every pre-draft misses. The drafter (== target) must still propose only accepted drafts afterwards, which
    holds only if its cache was rolled back past the corrupted tokens."""
    target, prompt = models["qwen2"], prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    stats = DecodeStats()
    drafter = MissingDrafter(target, k)
    assert overlap_ids(target, drafter, prompt, capacity, stats) == plain_ids(target, prompt, capacity)
    assert stats.predrafts > 0 and stats.predraft_hits == 0
    assert stats.accepted_by_position == stats.drafted_by_position


def test_independent_drafter_hits_and_misses_mixed(models):
    target, prompt = models["qwen2"], prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + 5
    stats = DecodeStats()
    drafter = ModelDrafter(models["qwen2_other"], 4)
    assert overlap_ids(target, drafter, prompt, capacity, stats) == plain_ids(target, prompt, capacity)
    assert stats.pipeline == "overlap" and stats.target_forwards > 0


def test_ngram_tree_drafts_are_not_drafted_ahead(models):
    target, prompt = models["llama"], prompt_ids()
    drafter = NgramDrafter(4, num_candidates=3)
    capacity = len(prompt) + NEW_TOKENS + drafter.max_draft_tokens + 1
    assert overlap_ids(target, drafter, prompt, capacity, DecodeStats()) == plain_ids(target, prompt, capacity)


def make_dflash(target, block_size: int) -> DFlashDraftModel:
    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashConfig.for_target(target.config, num_layers=2, block_size=block_size))
    for param in model.parameters():
        param.data.mul_(2.0) if param.dim() == 2 else None
    return model.eval()


class TruthfulDFlash(DFlashDrafter):
    """A real DFlash drafter whose drafts (and pre-drafts) are overwritten by the target's greedy continuation:
    every pre-draft hits, so ``observe`` alone must keep the context right between real forward passes."""

    def __init__(self, model, target, k, prompt_length: int, expected: list[int]) -> None:
        super().__init__(model, target, k)
        self.prompt_length, self.expected = prompt_length, expected

    def _truth(self, after: int, count: int) -> torch.Tensor:
        done = after - self.prompt_length
        return torch.tensor(self.expected[done : done + count], dtype=torch.int64)

    def propose(self, sequence, num_draft_tokens, params, generator):
        draft = super().propose(sequence, num_draft_tokens, params, generator)
        return Draft(tokens=self._truth(len(sequence), len(draft.tokens)), q_draft=None)

    def propose_ahead(self, sequence, block, num_draft_tokens, params, generator):
        draft = super().propose_ahead(sequence, block, num_draft_tokens, params, generator)
        if draft is None:
            return None
        return Draft(tokens=self._truth(len(sequence) + len(block), len(draft.tokens)), q_draft=None)


@pytest.mark.parametrize("target_key", ["qwen2", "llama"])
@pytest.mark.parametrize("block_size,k", [(8, 3), (8, 7), (16, 6)])
def test_dflash_drafter_in_the_overlapped_pipeline_is_lossless(models, target_key, block_size, k):
    target, prompt = models[target_key], prompt_ids()
    capacity = len(prompt) + NEW_TOKENS + block_size
    stats = DecodeStats()
    drafter = DFlashDrafter(make_dflash(target, block_size), target, k)
    assert overlap_ids(target, drafter, prompt, capacity, stats) == plain_ids(target, prompt, capacity)
    assert (stats.predrafts > 0) == (k + 1 < block_size - 1)  # a block that fills every mask leaves no room ahead


def test_dflash_hits_keep_the_context_exact(models):
    target, prompt = models["llama"], prompt_ids()
    capacity = len(prompt) + 2 * NEW_TOKENS
    expected = plain_ids(target, prompt, capacity, limit=2 * NEW_TOKENS)  # the truth, also past the tokens read
    drafter = TruthfulDFlash(make_dflash(target, 8), target, 3, len(prompt), expected)
    stats = DecodeStats()
    assert overlap_ids(target, drafter, prompt, capacity, stats) == expected[:NEW_TOKENS]
    assert stats.predraft_hits == stats.predrafts > 0
    committed = len(prompt) + stats.committed_tokens + 1
    assert drafter.context_length == committed - 1  # every committed position but the pending one
    taps = target(torch.tensor(prompt.tolist() + expected)[None, : committed - 1], hidden_layers=drafter.hidden_layers,
                  logits="none").hidden_states
    fresh = drafter.model.context_kv(drafter.model.project_context(taps), torch.arange(committed - 1)[None])
    for layer, (keys, _) in enumerate(fresh):
        torch.testing.assert_close(drafter.cache.keys[layer, :, :, : committed - 1], keys, atol=1e-4, rtol=1e-4)


def test_dflash_propose_ahead_equals_the_block_with_known_tokens(models):
    """Pre-draft logits = the block [pending, block..., MASK...] at the same positions (checked token by token)."""
    target, prompt = models["qwen2"], prompt_ids()
    drafter = DFlashDrafter(make_dflash(target, 8), target, 3)
    drafter.reset(64)
    sequence = prompt.tolist()
    with torch.inference_mode():
        taps = target(prompt[None, :-1], hidden_layers=drafter.hidden_layers).hidden_states  # the last id is pending
        drafter.observe(sequence, -1, taps)
        ahead = drafter.propose_ahead(sequence, [5, 6, 7], 3, GREEDY, None)
        logits = drafter.block_logits(sequence[-1], len(sequence) - 1, known=[5, 6, 7])
    assert ahead.tokens.tolist() == logits[4:8].argmax(-1).tolist()  # bonus guess + 3 drafts
    assert drafter.propose_ahead(sequence, [1] * 6, 3, GREEDY, None) is None  # no mask left for a bonus guess


def test_speculation_cache_hits_only_the_outcome_it_assumed():
    cache = SpeculationCache()
    draft = Draft(tokens=torch.tensor([9, 9]), q_draft=None)
    cache.put(3, 42, draft)
    assert cache.take(StepOutcome(emitted=[1, 2, 3, 42], kept_positions=[0, 1, 2, 3])) is draft
    assert cache.take(StepOutcome(emitted=[1, 2, 3, 42], kept_positions=[0, 1, 2, 3])) is None  # emptied
    cache.put(3, 42, draft)
    assert cache.take(StepOutcome(emitted=[1, 2, 43], kept_positions=[0, 1, 2])) is None
    cache.put(3, 42, draft)
    assert cache.take(StepOutcome(emitted=[1, 2, 3, 41], kept_positions=[0, 1, 2, 3])) is None


def test_seeded_sampling_is_reproducible_and_closing_early_leaves_the_drafter_usable(models):
    target, prompt = models["qwen2"], prompt_ids()
    params = SamplingParams(temperature=0.8, seed=3)
    drafter = ModelDrafter(models["qwen2_other"], 3)
    runs = []
    for limit in (7, NEW_TOKENS, NEW_TOKENS):  # the first run is closed mid-way with the drafter busy
        steps = overlap_decode(target, drafter, prompt, params, params.make_generator(), 64, DecodeStats(),
                               shared_worker())
        runs.append(run(steps, limit))
    assert runs[1] == runs[2] and runs[0] == runs[1][:7]


def test_pre_draft_keys_the_bonus_guess_and_keeps_each_token_with_its_distribution():
    """The guess (token 0) becomes the key; drafts 1.. keep their own rows of q_draft (a shift would be lossy)."""
    from dflash2.decode.overlap import _pre_draft
    from dflash2.drafters.base import Drafter

    q_rows = torch.eye(4)[[1, 2, 3]]  # row i is one-hot at token i + 1: misalignment is visible

    class Scripted(Drafter):
        def propose(self, sequence, num_draft_tokens, params, generator):
            raise AssertionError("not called")

        def propose_ahead(self, sequence, block, num_draft_tokens, params, generator):
            assert (sequence, block, num_draft_tokens) == ([5, 6], [7, 8], 2)
            return Draft(tokens=torch.tensor([1, 2, 3]), q_draft=q_rows)

    speculation = SpeculationCache()
    block = Draft(tokens=torch.tensor([7, 8]), q_draft=None)
    _pre_draft(shared_worker(), Scripted(2), [5, 6], block, 2, GREEDY, None, speculation).result()
    hit = speculation.take(StepOutcome(emitted=[7, 8, 1], kept_positions=[0, 1, 2]))
    assert hit.tokens.tolist() == [2, 3]
    assert torch.equal(hit.q_draft, q_rows[1:])
