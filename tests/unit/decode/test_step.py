"""decode/step.py, the settle every loop shares: a chain is a rollback, a tree branch is compacted, the step is
counted once, the drafter's observation holds the kept positions' states, a logits constraint sees the row before
the verdict and the committed tokens after it, and a prompt chunk's observation starts over only at position 0."""

from __future__ import annotations

import torch

from dflash2.decode.stats import DecodeStats
from dflash2.decode.step import prompt_observation, settle
from dflash2.drafters.base import Draft
from dflash2.verify.sampling import GREEDY

VOCAB = 10


class FakeCache:
    """A KVCommit that records what was asked of it (pure commit logic under test)."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.compacted: list[tuple[list[int], int]] = []

    def rollback(self, length: int) -> None:
        self.length = length

    def compact(self, source_slots: torch.Tensor, destination: int) -> None:
        self.compacted.append((source_slots.tolist(), destination))
        self.length = destination + len(source_slots)


def one_hot_logits(next_ids: list[int]) -> torch.Tensor:
    """[n + 1, V] logits whose argmax at input i is next_ids[i]."""
    logits = torch.zeros(len(next_ids), VOCAB)
    logits[torch.arange(len(next_ids)), torch.tensor(next_ids)] = 5.0
    return logits


def taps(n: int) -> dict[int, torch.Tensor]:
    """Layer 3's states over n inputs: position i holds the value i."""
    return {3: torch.arange(n, dtype=torch.float32).view(1, n, 1)}


def test_a_chain_keeps_its_accepted_prefix_and_the_drafter_observes_those_positions():
    cache, stats = FakeCache(length=7), DecodeStats()
    draft = Draft(tokens=torch.tensor([4, 5, 6]), q_draft=None)
    # the target agrees with 4 and 5, then wants 9 (not 6): 2 accepted, 9 recovered
    step = settle(draft, one_hot_logits([4, 5, 9, 1]), taps(4), cache=cache, start=3, sequence=[1, 2, 8],
                  layers=(3,), params=GREEDY, generator=None, stats=stats)
    assert step.outcome.emitted == [4, 5, 9] and step.start == 3
    assert cache.length == 3 + 3 and not cache.compacted  # the pending token + 2 drafts: a rollback
    assert (stats.target_forwards, stats.committed_tokens) == (1, 3)
    assert stats.accepted_by_position == [1, 1, 0] and stats.drafted_by_position == [1, 1, 1]
    observation = step.observation
    assert observation.sequence == [1, 2, 8, 4, 5, 9] and observation.num_accepted == 2
    assert observation.taps[0].flatten().tolist() == [0.0, 1.0, 2.0]


def test_a_tree_compacts_its_accepted_branch():
    cache = FakeCache(length=10)
    # nodes: 0 = 4 (root child), 1 = 6 (root child), 2 = 7 (child of node 1); the target follows 6 then 7
    draft = Draft(tokens=torch.tensor([4, 6, 7]), q_draft=None, parents=[-1, -1, 1])
    step = settle(draft, one_hot_logits([6, 0, 7, 2]), taps(4), cache=cache, start=10, sequence=[1, 3],
                  layers=(3,), params=GREEDY, generator=None, stats=DecodeStats())
    assert step.outcome.emitted == [6, 7, 2]
    assert step.outcome.kept_positions == [0, 2, 3] and cache.compacted == [([10, 12, 13], 10)]
    assert step.observation.taps[0].flatten().tolist() == [0.0, 2.0, 3.0]  # the branch's states, in order


def test_a_constraint_masks_the_row_before_the_verdict_and_hears_the_committed_tokens():
    class NoFives:
        def __init__(self) -> None:
            self.seen: list[tuple[list[int], int]] = []
            self.advanced: list[list[int]] = []

        def constrain(self, draft, logits):
            self.seen.append((draft.tokens.tolist(), logits.shape[0]))
            logits = logits.clone()
            logits[:, 5] = float("-inf")
            return logits

        def advance(self, emitted):
            self.advanced.append(list(emitted))

    constraint = NoFives()
    draft = Draft(tokens=torch.tensor([4, 5]), q_draft=None)
    step = settle(draft, one_hot_logits([4, 5, 1]), taps(3), cache=FakeCache(0), start=0, sequence=[2],
                  layers=(), params=GREEDY, generator=None, stats=DecodeStats(), constraint=constraint)
    assert constraint.seen == [([4, 5], 3)]
    assert step.outcome.emitted[:1] == [4] and step.outcome.emitted[1] != 5  # the masked draft is rejected
    assert constraint.advanced == [step.outcome.emitted] and step.observation.taps == ()


def test_a_prompt_chunk_starts_the_drafter_over_only_at_position_zero():
    states = (torch.zeros(1, 4, 2),)
    assert prompt_observation([1, 2, 3, 4, 5], 0, states).num_accepted == -1
    later = prompt_observation([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, states)
    assert later.num_accepted == 0 and later.sequence[-1] == 9 and later.taps is states
