"""End to end at T > 0 through ``Engine.generate``: DFlash and DFlash2 drafters, chains and trees, the selector's
sparse q over a draft vocabulary, top-k and top-p, the sync and overlapped pipelines. The first four generated
tokens must have exactly the target's distribution, jointly and by position (checks: tests/statistical/decode_paths.py).

Each case runs RUNS seeded requests by default (a run through the real loop costs 10-30 ms of CPU here) and
SLOW_RUNS under ``-m slow``. Every case has a companion that breaks one rule in the same path and asserts that the
same checks reject it, with at most 500 requests: fewer than the test's own, so the test would reject the broken
rule too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dflash2.drafters.dflash import DFlashDrafter
from dflash2.verify import SamplingParams
from tests.statistical.decode_paths import (
    accept_the_argmax,
    assert_caught,
    assert_lossless,
    broken,
    closing_engine_samples,
    drop_the_residual,
    exact_joint,
    follow_the_argmax_child,
    swap_p_and_q,
    tiny_drafter_model,
    tiny_engine,
    tiny_target,
    unwarped,
)

RUNS = 1000
SLOW_RUNS = 10_000
PROMPT = [1, 2, 3]


@dataclass(frozen=True)
class Case:
    drafter: str  # "dflash" | "dflash2" (path selector + dynamic convolution)
    draft_vocab: bool  # the drafter's head scores 4 of the 6 ids
    num_paths: int  # 1: a chain of 3 drafts; 2: a tree of 6 nodes
    params: SamplingParams
    pipeline: str = "sync"


CASES = {
    "dflash-chain-top-k": Case("dflash", False, 1, SamplingParams(temperature=1.0, top_k=4)),
    "dflash-chain-overlap": Case("dflash", False, 1, SamplingParams(temperature=0.9), "overlap"),
    "dflash2-chain-draft-vocab-top-p": Case("dflash2", True, 1, SamplingParams(temperature=0.9, top_p=0.8)),
    "dflash-tree-top-k-top-p": Case("dflash", False, 2, SamplingParams(temperature=1.0, top_k=5, top_p=0.9)),
    "dflash2-tree-draft-vocab": Case("dflash2", True, 2, SamplingParams(temperature=1.1, top_k=4)),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("vocab6-target"))


def engine_for(target, case: Case, duplicate_draft_id: bool = False):
    model = tiny_drafter_model(target, seed=2 if case.drafter == "dflash2" else 1, selector=case.drafter == "dflash2",
                               draft_vocab=case.draft_vocab)
    if duplicate_draft_id:  # what an unchecked checkpoint could hold: id 4 twice (rows 0 and 3), id 3 gone
        model.draft_vocab = torch.tensor([4, 1, 0, 4])
        model._sub_head = None
    return tiny_engine(target, DFlashDrafter(model, target, 3, num_paths=case.num_paths), case.pipeline)


def samples_of(target, case: Case, runs: int, duplicate_draft_id: bool = False) -> torch.Tensor:
    return closing_engine_samples(engine_for(target, case, duplicate_draft_id), PROMPT, case.params, runs)


@pytest.mark.parametrize("runs", [RUNS, pytest.param(SLOW_RUNS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(CASES))
def test_drafted_generation_has_the_target_distribution(target, name, runs):
    case = CASES[name]
    assert_lossless(samples_of(target, case, runs), exact_joint(target, PROMPT, case.params))


# the companions: (case, what is broken, how, requests)
BROKEN = {
    "argmax-acceptance": ("dflash-chain-top-k", "verify_chain", accept_the_argmax, 400),
    "residual-dropped": ("dflash-chain-top-k", "verify_chain", drop_the_residual, 500),
    "overlap-p-q-swapped": ("dflash-chain-overlap", "verify_chain", swap_p_and_q, 400),
    "selector-p-q-swapped": ("dflash2-chain-draft-vocab-top-p", "verify_chain", swap_p_and_q, 200),
    "top-p-not-applied": ("dflash2-chain-draft-vocab-top-p", "logits_to_probs", unwarped, 150),
    "tree-argmax-child": ("dflash-tree-top-k-top-p", "verify_tree", follow_the_argmax_child, 200),
    "tree-warps-not-applied": ("dflash2-tree-draft-vocab", "logits_to_probs", unwarped, 150),
}


@pytest.mark.parametrize("rule", list(BROKEN))
def test_a_broken_rule_is_caught(target, rule):
    name, attribute, replacement, runs = BROKEN[rule]
    case = CASES[name]
    with broken(attribute, replacement):
        samples = samples_of(target, case, runs)
    assert_caught(samples, exact_joint(target, PROMPT, case.params))


def test_a_duplicate_draft_vocabulary_id_is_caught(target):
    """The selector's q is scattered from candidate rows to ids: an id held by two rows gets one row's q while it
    is drafted with the sum of both, so it is over-accepted (why checkpoints are validated on load)."""
    case = CASES["dflash2-chain-draft-vocab-top-p"]
    samples = samples_of(target, case, 250, duplicate_draft_id=True)
    assert_caught(samples, exact_joint(target, PROMPT, case.params))
