"""Draft lengths that pay under load: how many drafts each running request gets in the next ragged forward.

Model: a forward over N tokens costs ``c0 + c1 * N`` seconds (c0: reading the weights once, c1: compute per
token; both fitted online from measured steps). A row's i-th draft is accepted with probability ``alpha ** i``
(``alpha``: that request's running acceptance rate), so it is worth ``alpha ** i`` expected tokens. Drafts are
granted greedily, best first, while one more token raises the expected tokens per second of the step:
``gain > E * c1 / (c0 + c1 * N)`` for the step's current expected tokens E and tokens N. At batch 1 a token is
nearly free (c1 * N << c0) and drafts pay; with many rows the forward turns compute-bound and weak drafts are
dropped, down to speculation off. Drafts never change what is generated, only how fast.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class Acceptance:
    """A request's running draft acceptance rate, decayed so that it follows the text (prior 0.5)."""

    accepted: float = 0.0
    tested: float = 0.0
    decay: float = 0.9

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        tested = num_accepted + (num_accepted < num_drafted)  # drafts up to and including the first rejection
        self.accepted = self.decay * self.accepted + num_accepted
        self.tested = self.decay * self.tested + tested

    @property
    def alpha(self) -> float:
        return (self.accepted + 1.0) / (self.tested + 2.0)


class CostModel:
    """Least-squares fit of step seconds = c0 + c1 * tokens over the last ``window`` steps."""

    def __init__(self, window: int = 128, prior: tuple[float, float] = (1.0, 1.0 / 32)) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior = prior  # (c0, c1) until the steps seen vary enough in size for a fit

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


def plan_draft_lengths(
    max_drafts: list[int],  # per decode row: the most drafts its request allows this step
    alphas: list[float],  # per decode row: its acceptance rate
    base_tokens: int,  # tokens the step processes without drafts (pending tokens + prompts being prefilled)
    base_expected: float,  # tokens the step commits without drafts (one per row)
    c0: float,
    c1: float,
) -> list[int]:
    """Drafts per row that maximise expected committed tokens per second of the step (greedy on the gains)."""
    plan = [0] * len(max_drafts)
    heap = [(-alpha, row) for row, (k, alpha) in enumerate(zip(max_drafts, alphas)) if k > 0]
    heapq.heapify(heap)
    expected, tokens = base_expected, base_tokens
    while heap:
        negative_gain, row = heapq.heappop(heap)
        gain = -negative_gain
        if gain * (c0 + c1 * tokens) <= expected * c1:
            break  # the best remaining draft would lower tokens per second; the rest are worse
        plan[row] += 1
        expected += gain
        tokens += 1
        if plan[row] < max_drafts[row]:
            heapq.heappush(heap, (-(alphas[row] ** (plan[row] + 1)), row))
    return plan
