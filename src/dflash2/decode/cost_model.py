"""The one cost model of the decode loops, and the one acceptance estimator.

:class:`Acceptance`: a request's running draft acceptance rate (alpha), from decayed counts.
:class:`ForwardCost`: a target forward over N tokens costs ``c0 + c1 * N`` seconds (c0: reading the weights once,
c1: compute per token), fitted online from measured forwards. The batch planner (``decode/scheduler.py``) prices
the drafts of a ragged step with it; the adaptive draft length (``decode/draft_length.py``) prices a verification
of k drafts as ``1 + growth * k`` plain steps, ``growth = c1 / (c0 + c1)``.
:class:`StepCosts`: one speculative step, sync vs overlapped: what overlap can gain, from measured times.

Per target pass (one step), with times measured when each side runs alone:
- sync:    ``T_sync = D + V``: draft the block (D), then verify it (V); each side idles while the other works.
- overlap: ``T_overlap = max(s_V * V, s_D * A) + (1 - h) * D``. While the target verifies, the drafter pre-drafts
  ahead (A: the bonus guess + the next block, about D * (k + 1) / k); on a hit (rate h) the next verification
  starts at once, on a miss the target waits for a fresh draft (D). ``s_V``, ``s_D`` >= 1 are the slowdowns of
  each side while both run: on a 2-core CPU they share cores and memory bandwidth (measured about 1.3 - 2),
  on a GPU with the drafter on its own stream they are close to 1 (a batch-1 target leaves most SMs idle).
Tokens per pass (tau) are the same in both pipelines, so the speedup is ``T_sync / T_overlap``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class Acceptance:
    """A running draft acceptance rate: decayed counts of accepted drafts and of drafts tested (up to and
    including the first rejection of each step), starting from prior pseudo-counts that decay away too."""

    prior_accepted: float = 1.0  # the default prior: alpha = 0.5 from one accepted and one rejected draft
    prior_rejected: float = 1.0
    decay: float = 0.9  # weight of the past per verification, so that the rate follows the text

    def __post_init__(self) -> None:
        self.accepted = self.prior_accepted
        self.tested = self.prior_accepted + self.prior_rejected

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        tested = num_accepted + (num_accepted < num_drafted)
        self.accepted = self.decay * self.accepted + num_accepted
        self.tested = self.decay * self.tested + tested

    @property
    def alpha(self) -> float:
        """Estimated probability that a draft is accepted given that the previous one was."""
        return self.accepted / self.tested


class ForwardCost:
    """Least-squares fit of forward seconds = c0 + c1 * tokens over the last ``window`` forwards."""

    def __init__(self, window: int = 128, prior: tuple[float, float] = (1.0, 1.0 / 32)) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior = prior  # (c0, c1) until the forwards seen vary enough in size for a fit

    def record(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))

    def coefficients(self) -> tuple[float, float]:
        if len(self.samples) < 8:
            return self.prior
        tokens, seconds = np.array(self.samples, dtype=np.float64).T
        if tokens.std() < 1.0:
            return self.prior
        c1, c0 = np.polyfit(tokens, seconds, 1)
        if c0 <= 0 or c1 <= 0:
            return self.prior
        return float(c0), float(c1)

    def growth(self) -> float:
        """Extra cost of one more token over a one-token forward, relative to it: c1 / (c0 + c1)."""
        c0, c1 = self.coefficients()
        return c1 / (c0 + c1)


@dataclass(frozen=True)
class StepCosts:
    draft_s: float  # D: drafting one block alone (seconds)
    verify_s: float  # V: one verification pass alone (seconds)
    hit_rate: float  # h: share of steps whose pre-draft matched the outcome (all accepted, bonus guessed)
    ahead_s: float | None = None  # A: pre-drafting one block ahead alone; None: D * (k + 1) / k
    num_draft_tokens: int = 4  # k, for the default A
    target_slowdown: float = 1.0  # s_V: verification time while the drafter runs / alone
    drafter_slowdown: float = 1.0  # s_D: drafting time while the target runs / alone

    @property
    def ahead(self) -> float:
        if self.ahead_s is not None:
            return self.ahead_s
        return self.draft_s * (self.num_draft_tokens + 1) / self.num_draft_tokens

    def sync_step(self) -> float:
        return self.draft_s + self.verify_s

    def overlap_step(self) -> float:
        concurrent = max(self.target_slowdown * self.verify_s, self.drafter_slowdown * self.ahead)
        return concurrent + (1.0 - self.hit_rate) * self.draft_s

    def overlap_speedup(self) -> float:
        """Predicted tokens/s of overlap over sync (> 1: overlap wins)."""
        return self.sync_step() / self.overlap_step()


def break_even_slowdown(costs: StepCosts) -> float:
    """The common slowdown s = s_V = s_D at which overlap stops paying (speedup 1)."""
    concurrent = max(costs.verify_s, costs.ahead)
    return (costs.sync_step() - (1.0 - costs.hit_rate) * costs.draft_s) / concurrent
