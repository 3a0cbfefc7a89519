"""Draft lengths that pay under load: how many drafts each running request gets in the next ragged forward.

Model: a forward over N tokens costs ``c0 + c1 * N`` seconds (``decode/cost_model.ForwardCost``, fitted online
from measured steps). A row's i-th draft is accepted with probability ``alpha ** i`` (``alpha``: that request's
running acceptance rate, ``decode/cost_model.Acceptance``), so it is worth ``alpha ** i`` expected tokens. Drafts
are granted greedily, best first, while one more token raises the expected tokens per second of the step:
``gain > E * c1 / (c0 + c1 * N)`` for the step's current expected tokens E and tokens N. At batch 1 a token is
nearly free (c1 * N << c0) and drafts pay; with many rows the forward turns compute-bound and weak drafts are
dropped, down to speculation off. Drafts never change what is generated, only how fast.
"""

from __future__ import annotations

import heapq


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
