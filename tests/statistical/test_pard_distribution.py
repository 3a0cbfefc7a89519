"""End to end at T > 0 through ``Engine.generate`` with the PARD drafter (drafts of one forward over mask positions,
each position sampled from its own q_draft): the first four generated tokens must have exactly the target's
distribution (checks: tests/statistical/decode_paths.py), with top-k / top-p, the overlapped pipeline, a draft
vocabulary (the head scores 4 of the 6 ids), lead tokens (a sampled chain; a tree below a trunk) and drafts trimmed
by their confidence (the adaptive policy). A companion breaks the chain rule and must be caught."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import pytest
import torch

from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength
from dflash2.decode.speculative import speculative_decode
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.pard import PardDrafter, VocabSubsetHead
from dflash2.verify import SamplingParams
from tests.statistical.decode_paths import (DEPTH, DRAFT_VOCAB, VOCAB, assert_caught, assert_lossless, broken,
                                            closing_engine_samples, exact_joint, swap_p_and_q, tiny_engine, tiny_target)
from tests.unit.drafters.test_pard import PricedRows

RUNS = 1000
SLOW_RUNS = 10_000
PROMPT = [1, 2, 3]
MASK = VOCAB - 1  # the mask id (5) is never drafted; the residual still gives it its mass


@dataclass(frozen=True)
class Case:
    params: SamplingParams
    pipeline: str = "sync"
    draft_vocab: bool = False
    lead: int = 0  # lead tokens (pard:L+k): drafted one per pass, sampled with their own q_draft
    width: int = 1  # a tree of width W (below the lead's trunk)
    trimmed: bool = False  # the adaptive policy trims each draft by its confidences (rows priced steeply)


CASES = {
    "pard-chain-top-p": Case(SamplingParams(temperature=0.9, top_p=0.8)),
    "pard-chain-overlap-top-k": Case(SamplingParams(temperature=1.0, top_k=4), "overlap"),
    "pard-chain-draft-vocab": Case(SamplingParams(temperature=1.1), draft_vocab=True),
    "pard-lead-chain-top-p": Case(SamplingParams(temperature=0.9, top_p=0.8), lead=1),
    "pard-lead-tree": Case(SamplingParams(temperature=1.0), lead=1, width=2),
    "pard-chain-trimmed-top-p": Case(SamplingParams(temperature=0.9, top_p=0.8), trimmed=True),
    "pard-tree-trimmed": Case(SamplingParams(temperature=1.0), width=2, trimmed=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target and the drafter's network (another tiny model, sharper: q far from p)."""
    return tiny_target(tmp_path_factory.mktemp("pard-target")), tiny_target(tmp_path_factory.mktemp("pard-draft"),
                                                                           seed=7, scale=1.5)


def samples_of(models, case: Case, runs: int) -> torch.Tensor:
    target, draft = models
    if case.draft_vocab:  # a copy whose head scores DRAFT_VOCAB only (load_pard_model's VocabSubsetHead)
        draft = copy.deepcopy(draft)
        head = torch.nn.Linear(draft.config.hidden_size, len(DRAFT_VOCAB), bias=False)
        head.weight.data = draft.lm_head.weight.data[DRAFT_VOCAB].clone()
        draft.lm_head = VocabSubsetHead(head, DRAFT_VOCAB, VOCAB)
    drafter = PardDrafter(draft, MASK, 3, num_paths=case.width, lead_tokens=case.lead)
    if case.trimmed:
        return trimmed_samples(target, drafter, case.params, runs)
    return closing_engine_samples(tiny_engine(target, drafter, case.pipeline), PROMPT, case.params, runs)


def trimmed_samples(target, drafter: PardDrafter, params: SamplingParams, runs: int) -> torch.Tensor:
    """[runs, DEPTH] first tokens of the speculative loop with the adaptive policy trimming every draft, rows priced
    at (1 + n) / 2 plain steps (the engine keeps a seeded request's drafts whole, so the loop is driven here, one
    generator per run)."""
    out = []
    for run in range(runs):
        policy = AdaptiveDraftLength(AdaptiveConfig(k_max=3, per_pass=True), PricedRows())
        steps = speculative_decode(target, drafter, torch.tensor(PROMPT), params,
                                   torch.Generator().manual_seed(run), len(PROMPT) + DEPTH + 8, DecodeStats(), policy)
        out.append(list(itertools.islice(itertools.chain.from_iterable(steps), DEPTH)))
    return torch.tensor(out)


@pytest.mark.parametrize("runs", [RUNS, pytest.param(SLOW_RUNS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_pard_generation_has_the_target_distribution(models, name, runs):
    case = CASES[name]
    assert_lossless(samples_of(models, case, runs), exact_joint(models[0], PROMPT, case.params))


def test_pard_with_p_and_q_swapped_is_caught(models):
    case = CASES["pard-chain-top-p"]
    with broken("verify_chain", swap_p_and_q):
        samples = samples_of(models, case, 400)
    assert_caught(samples, exact_joint(models[0], PROMPT, case.params))
