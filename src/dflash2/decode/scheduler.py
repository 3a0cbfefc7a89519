"""Draft lengths that pay under load: how many drafts each running request gets in the next ragged forward.

Model: a forward over N tokens costs ``c0 + c1 * N`` seconds (``decode/cost_model.ForwardCost``, fitted online
from measured steps), and a row that drafts costs its drafter's time first (``decode/cost_model.DraftCost``: one
pass of a block drafter whatever k, or one pass per token of a draft model); drafting runs row by row before the
forward. A row's i-th draft is accepted with probability ``reach[i]`` (that request's acceptance by position,
``decode/cost_model.Acceptance``), so it is worth ``reach[i]`` expected tokens. Drafts are granted greedily, the
best gain per second first, while they raise the expected tokens per second of the step: an extension worth
``gain`` tokens for ``cost`` seconds pays when ``gain / cost > E / T`` (the step's current expected tokens E and
seconds T). A row's first drafts carry its drafting pass, so they are weighed as a bundle (the best prefix). At
batch 1 a token is nearly free (c1 * N << c0) and drafts pay; with many rows the forward turns compute-bound and
every drafting pass costs as much as the rows it serves gain, so weak drafts are dropped, down to speculation off.
Drafts never change what is generated, only how fast.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowDrafts:
    """What one decode row may draft this step and what drafting costs it."""

    max_drafts: int  # the most drafts its request allows this step (0: none)
    reach: list[float]  # [>= max_drafts] probability that its i-th draft is accepted (non-increasing)
    pass_s: float = 0.0  # seconds charged once if the row drafts at all (a block drafter's pass)
    token_s: float = 0.0  # seconds per draft token (a draft model's pass per token)


def plan_draft_lengths(rows: list[RowDrafts], base_tokens: int, base_expected: float, c0: float, c1: float
                       ) -> list[int]:
    """Drafts per row that maximise expected committed tokens per second of the step (greedy on gain per second).

    base_tokens: tokens the step processes without drafts (pending tokens + prompts being prefilled);
    base_expected: tokens it commits without drafts (one per decode row)."""
    plan = [0] * len(rows)
    expected, seconds = base_expected, c0 + c1 * base_tokens
    while True:
        best = _best_extension(rows, plan, c1)
        if best is None:
            return plan
        row, extra, gain, cost = best
        if gain * seconds <= expected * cost:
            return plan  # the best remaining extension would lower tokens per second; the rest are worse
        plan[row] += extra
        expected += gain
        seconds += cost


def _best_extension(rows: list[RowDrafts], plan: list[int], c1: float) -> tuple[int, int, float, float] | None:
    """(row, extra drafts, gain, cost) of the extension with the most expected tokens per second, or None."""
    best: tuple[int, int, float, float] | None = None
    for index, row in enumerate(rows):
        done = plan[index]
        gain, cost = 0.0, row.pass_s if done == 0 else 0.0
        # once a row drafts, one more draft is its best extension (reach never grows with the position)
        last = row.max_drafts if done == 0 else min(done + 1, row.max_drafts)
        for position in range(done, last):
            gain += row.reach[position]
            cost += c1 + row.token_s
            if cost > 0 and (best is None or gain * best[3] > best[2] * cost):
                best = (index, position + 1 - done, gain, cost)
    return best
