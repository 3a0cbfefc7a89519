"""Draft lengths that pay under load: how many drafts each running request gets in the next ragged forward.

Model: a forward over N tokens costs ``forward_s(N)`` seconds (``decode/cost_model.ForwardCost.seconds``: the
measured mean time of each size seen, non-decreasing, linear in between, the fitted line's slope beyond; a CPU's
small forwards stream the weights and cost far less per token than its large ones), and a row that drafts costs its drafter's time first (``decode/cost_model.DraftCost``: one
pass of a block drafter whatever k, or one pass per token of a draft model); drafting runs row by row before the
forward. A row's i-th draft is accepted with probability ``reach[i]`` (that request's acceptance by position,
``decode/cost_model.Acceptance``), so it is worth ``reach[i]`` expected tokens. Drafts are granted greedily, the
best gain per second first, while they raise the expected tokens per second of the step: an extension worth
``gain`` tokens for ``cost`` seconds pays when ``gain / cost > E / T`` (the step's current expected tokens E and
seconds T). A row's first drafts carry its drafting pass, so they are weighed as a bundle (the best prefix). At
batch 1 a token is nearly free (forward_s(2) ~ forward_s(1)) and drafts pay; with many rows the forward turns compute-bound and
every drafting pass costs as much as the rows it serves gain, so weak drafts are dropped, down to speculation off.
Drafts never change what is generated, only how fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RowDrafts:
    """What one decode row may draft this step and what drafting costs it."""

    max_drafts: int  # the most drafts its request allows this step (0: none)
    reach: list[float]  # [>= max_drafts] probability that its i-th draft is accepted (non-increasing)
    pass_s: float = 0.0  # seconds charged once if the row drafts at all (a block drafter's pass)
    token_s: float = 0.0  # seconds per draft token (a draft model's pass per token)


def plan_draft_lengths(rows: list[RowDrafts], base_tokens: int, base_expected: float,
                       forward_s: Callable[[int], float]) -> list[int]:
    """Drafts per row that maximise expected committed tokens per second of the step (greedy on gain per second).

    base_tokens: tokens the step processes without drafts (pending tokens + prompts being prefilled);
    base_expected: tokens it commits without drafts (one per decode row); forward_s(N): seconds of a forward over N
    tokens (non-decreasing)."""
    plan = [0] * len(rows)
    tokens, expected = base_tokens, base_expected
    seconds = forward_s(tokens)
    while True:
        best = _best_extension(rows, plan, tokens, forward_s)
        if best is None:
            return plan
        row, extra, gain, cost = best
        if gain * seconds <= expected * cost:
            return plan  # the best remaining extension would lower tokens per second; the rest are worse
        plan[row] += extra
        tokens += extra
        expected += gain
        seconds += cost


def _best_extension(rows: list[RowDrafts], plan: list[int], tokens: int, forward_s: Callable[[int], float]
                    ) -> tuple[int, int, float, float] | None:
    """(row, extra drafts, gain, cost) of the extension with the most expected tokens per second, or None; a
    forward of ``tokens`` tokens is planned so far."""
    best: tuple[int, int, float, float] | None = None
    now = forward_s(tokens)
    for index, row in enumerate(rows):
        done = plan[index]
        gain, drafting = 0.0, row.pass_s if done == 0 else 0.0
        # once a row drafts, one more draft is its best extension (reach never grows with the position)
        last = row.max_drafts if done == 0 else min(done + 1, row.max_drafts)
        for position in range(done, last):
            extra = position + 1 - done
            gain += row.reach[position]
            drafting += row.token_s
            cost = drafting + forward_s(tokens + extra) - now
            if (cost > 0 or gain > 0) and (best is None or gain * best[3] > best[2] * cost):  # cost 0: free
                best = (index, extra, gain, cost)
    return best
