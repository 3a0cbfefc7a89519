"""End to end at T > 0: speculative sampling through the real loop has exactly the target's distribution.

A tiny random model with an 8-token vocabulary: the exact distribution of the 2nd, 3rd and 4th generated tokens is
computed by enumeration, then thousands of seeded speculative runs (sampled small-model drafts, q != p; and the
deterministic n-gram rule) are compared with it by a chi-square test.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash2.decode.speculative import speculative_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from dflash2.verify.sampling import SamplingParams, logits_to_probs
from tests.conftest import make_hf_model
from tests.pipelines import PIPELINES, speculative_steps
from tests.statistical.chisq import chi_square_p_value

VOCAB = 8
RUNS = 2000
PARAMS = SamplingParams(temperature=1.0, top_k=6)  # warps are applied before verification


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target, drafter): a fairly flat target and a peaked, different drafter, so that q is far from p."""
    models = []
    for seed, scale in ((5, 0.6), (6, 1.6)):
        path = tmp_path_factory.mktemp(f"vocab8-{seed}")
        hf = make_hf_model("qwen2", seed=seed, vocab_size=VOCAB, num_layers=1)
        for param in hf.parameters():
            param.data.mul_(scale)
        hf.save_pretrained(str(path))
        models.append(load_transformer(path, "fp32"))
    return models


@torch.inference_mode()
def exact_marginals(target, prompt: list[int], steps: int = 4, params: SamplingParams = PARAMS) -> list[torch.Tensor]:
    """P(token at generated position i) for i < steps, by enumerating every prefix (VOCAB ** (steps - 1))."""
    marginals = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(steps)]
    prefixes = {(): 1.0}
    for step in range(steps):
        next_prefixes = {}
        for prefix, mass in prefixes.items():
            logits = target(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            p = logits_to_probs(logits, params).double()
            marginals[step] += mass * p
            for token in range(VOCAB):
                if p[token] > 0:
                    next_prefixes[prefix + (token,)] = mass * float(p[token])
        prefixes = next_prefixes
    return marginals


def sample_runs(target, make_drafter, prompt: list[int], pipeline: str = "sync", params: SamplingParams = PARAMS
                ) -> torch.Tensor:
    """[RUNS, 4] first four generated tokens of seeded speculative runs."""
    out = []
    for run in range(RUNS):
        generator = torch.Generator().manual_seed(run)
        steps = speculative_steps(pipeline, target, make_drafter(), torch.tensor(prompt), params, generator, 64,
                                  DecodeStats())
        out.append(list(itertools.islice(itertools.chain.from_iterable(steps), 4)))
        steps.close()
    return torch.tensor(out)


def assert_matches(samples: torch.Tensor, marginals: list[torch.Tensor]) -> None:
    for position in (1, 2, 3):  # position 0 comes from prefill, not from verification
        observed = torch.bincount(samples[:, position], minlength=VOCAB)
        assert observed[marginals[position] <= 0].sum() == 0, "a token with zero target probability was emitted"
        p_value = chi_square_p_value(observed, marginals[position] / marginals[position].sum())
        assert p_value > 1e-3, (position, observed.tolist(), marginals[position].tolist())


# overlap + sampled drafts: covered in the default run by the frequent-hits test below (the rest: make test-all)
@pytest.mark.parametrize("pipeline", [pytest.param(p, marks=pytest.mark.slow) if p == "overlap" else p
                                      for p in PIPELINES])
@pytest.mark.parametrize("k", [1, 2])  # k = 1: token 3 comes from a pre-drafted block on a hit
def test_sampled_small_model_drafts_keep_the_target_distribution(tiny_pair, pipeline, k):
    target, draft = tiny_pair
    prompt = [1, 2, 3]
    samples = sample_runs(target, lambda: ModelDrafter(draft, k), prompt, pipeline)
    assert_matches(samples, exact_marginals(target, prompt))


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_deterministic_ngram_drafts_keep_the_target_distribution(tiny_pair, pipeline):
    target, _ = tiny_pair
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]  # the lookup always finds a continuation to propose
    samples = sample_runs(target, lambda: NgramDrafter(3), prompt, pipeline)
    assert_matches(samples, exact_marginals(target, prompt))


def test_ngram_tree_drafts_keep_the_target_distribution(tiny_pair):
    target, _ = tiny_pair
    prompt = [1, 2, 3, 1, 4, 5, 1, 2, 6, 1]  # [1] is followed by three different continuations: a tree
    samples = sample_runs(target, lambda: NgramDrafter(2, num_candidates=3), prompt)
    assert_matches(samples, exact_marginals(target, prompt))


def test_seeded_runs_are_reproducible(tiny_pair):
    target, draft = tiny_pair
    runs = []
    for _ in range(2):
        generator = torch.Generator().manual_seed(1234)
        steps = speculative_decode(target, ModelDrafter(draft, 3), torch.tensor([1, 2]), PARAMS, generator, 64, DecodeStats())
        runs.append(list(itertools.islice(itertools.chain.from_iterable(steps), 30)))
    assert runs[0] == runs[1]


def test_pre_drafted_blocks_keep_the_target_distribution_when_hits_are_frequent(tiny_pair):
    """A peaked target drafting for itself (q == p) at a low temperature: every draft is accepted and the bonus
    guess mostly right, so token 3 mostly comes from a block sampled ahead, with its q_draft; any misalignment of
    the two shows here."""
    _, peaked = tiny_pair
    prompt, params = [1, 2, 3], SamplingParams(temperature=0.25)
    stats = DecodeStats()
    generator = torch.Generator().manual_seed(0)
    for _ in speculative_steps("overlap", peaked, ModelDrafter(peaked, 1), torch.tensor(prompt), params, generator,
                               64, stats):
        pass
    assert stats.predraft_hit_rate > 0.4  # the regime this test is about
    samples = sample_runs(peaked, lambda: ModelDrafter(peaked, 1), prompt, "overlap", params)
    assert_matches(samples, exact_marginals(peaked, prompt, params=params))
