"""Draft lengths that pay under load: how many drafts each running request gets in the next ragged forward.

Model: a forward over N tokens costs ``forward_s(N)`` seconds (``decode/cost_model.ForwardCost.seconds``: the
measured mean time of each size seen, non-decreasing, linear in between, the fitted line's slope beyond; a CPU's
small forwards stream the weights and cost far less per token than its large ones), and a row that drafts costs its
drafter's time first (``decode/cost_model.DraftCost``: one pass of a block drafter whatever k, or one pass per token
of a draft model); drafting runs row by row before the forward. A row's i-th draft is accepted with probability
``reach[i]`` (that request's acceptance by position, ``decode/cost_model.Acceptance``), so it is worth ``reach[i]``
expected tokens. Drafts are granted greedily, the best gain per second first, while they raise the expected tokens
per second of the step: an extension worth ``gain`` tokens for ``cost`` seconds pays when ``gain / cost > E / T``
(the step's current expected tokens E and seconds T). A row's first drafts carry its drafting pass, so they are
weighed as a bundle (the best prefix). At batch 1 a token is nearly free (forward_s(2) ~ forward_s(1)) and drafts
pay; with many rows the forward turns compute-bound and every drafting pass costs as much as the rows it serves
gain, so weak drafts are dropped, down to speculation off. Rows whose drafts are passes of one shared network
(``RowDrafts.network``: the requests' pard drafters over the same 0.5B) draft in ONE forward of it per step, whose
seconds ``network_s[key](N)`` grow with the ids N it is fed (each drafting row's reads + its drafts): its weights
are read once, so one row's drafts cost only their ids once another row drafts. Greedy cannot see that bundle (the
first row would carry the whole pass), so the pass is planned as paid and the plan compared with the best plan
without it. Nor can it see past a jump in the forward's cost: on AMX tiles 1-16 rows cost about the same, the 17th
starts a second block of rows (+25 ms on the 1.5B) and rows 18-32 are nearly free again, so one draft at a time
never crosses it. Each plan is therefore also made against the lower convex hull of the forward's cost (the jump
spread over the rows it buys), and the plan kept is the one with the most expected tokens per second at the true
cost. Drafts never change what is generated, only how fast.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class RowDrafts:
    """What one decode row may draft this step and what drafting costs it."""

    max_drafts: int  # the most drafts its request allows this step (0: none)
    reach: list[float]  # [>= max_drafts] probability that its i-th draft is accepted (non-increasing)
    pass_s: float = 0.0  # seconds charged once if the row drafts at all (a block drafter's pass)
    token_s: float = 0.0  # seconds per draft token (a draft model's pass per token)
    network: Hashable | None = None  # drafts in the shared pass of this network (pass_s, token_s unused)
    reads: float = 0.0  # with a network: the ids it feeds the shared pass before its drafts (if it drafts)


NetworkSeconds = dict[Hashable, Callable[[float], float]]  # key -> one shared pass fed N ids: seconds


def plan_draft_lengths(rows: list[RowDrafts], base_tokens: int, base_expected: float,
                       forward_s: Callable[[int], float], network_s: NetworkSeconds | None = None) -> list[int]:
    """Drafts per row that maximise expected committed tokens per second of the step (greedy on gain per second).

    base_tokens: tokens the step processes without drafts (pending tokens + prompts being prefilled);
    base_expected: tokens it commits without drafts (one per decode row); forward_s(N): seconds of a forward over N
    tokens (non-decreasing); network_s: the shared passes' seconds, for rows that name a network."""
    network_s = network_s or {}
    networks = sorted({row.network for row in rows if row.network is not None and row.max_drafts > 0}, key=repr)
    hull = lower_hull(forward_s, base_tokens, base_tokens + sum(row.max_drafts for row in rows))
    # Each network's pass planned as run (its rows' drafts priced by the ids they add), or left out: all of them,
    # or one at a time where there are several.
    left_out = ([networks] if networks else []) + ([[key] for key in networks] if len(networks) > 1 else [])
    variants = [rows] + [[RowDrafts(0, []) if row.network in closed else row for row in rows] for closed in left_out]
    candidates = [_greedy(kept, base_tokens, base_expected, cost, network_s) for kept in variants
                  for cost in (forward_s, hull)]
    return max(candidates, key=lambda plan: rate_of_plan(rows, plan, base_tokens, base_expected, forward_s,
                                                         network_s))


def lower_hull(forward_s: Callable[[int], float], lo: int, hi: int) -> Callable[[int], float]:
    """The lower convex hull of ``forward_s`` over the sizes ``lo .. hi`` (``forward_s`` outside them): a cost
    whose every extra token costs at least what the one before it did, so a jump is spread over the sizes past it."""
    if hi - lo < 2:
        return forward_s
    hull: list[tuple[int, float]] = []
    for size in range(lo, hi + 1):
        point = (size, forward_s(size))
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], point) <= 0:  # hull[-1] lies on or above the chord
            hull.pop()
        hull.append(point)
    sizes = [size for size, _ in hull]

    def seconds(num_tokens: int) -> float:
        if not lo <= num_tokens <= hi:
            return forward_s(num_tokens)
        i = bisect.bisect_left(sizes, num_tokens)
        if sizes[i] == num_tokens:
            return hull[i][1]
        (a, t_a), (b, t_b) = hull[i - 1], hull[i]
        return t_a + (t_b - t_a) * (num_tokens - a) / (b - a)

    return seconds


def _turn(o: tuple[int, float], a: tuple[int, float], b: tuple[int, float]) -> float:
    """> 0 when o -> a -> b turns left (a lies below the chord o -> b)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def rate_of_plan(rows: list[RowDrafts], plan: list[int], base_tokens: int, base_expected: float,
                 forward_s: Callable[[int], float], network_s: NetworkSeconds) -> float:
    """Expected committed tokens per second of a step that drafts ``plan``."""
    expected = base_expected + sum(sum(row.reach[:k]) for row, k in zip(rows, plan))
    seconds = forward_s(base_tokens + sum(plan))
    fed: dict[Hashable, float] = {}
    for row, k in zip(rows, plan):
        if k and row.network is not None:
            fed[row.network] = fed.get(row.network, 0.0) + row.reads + k
        elif k:
            seconds += row.pass_s + row.token_s * k
    seconds += sum(network_s[key](ids) for key, ids in fed.items())
    return expected / seconds


def _greedy(rows: list[RowDrafts], base_tokens: int, base_expected: float, forward_s: Callable[[int], float],
            network_s: NetworkSeconds) -> list[int]:
    """The greedy plan, every named network's pass counted as run (its time at no ids fed: the weights' read)."""
    plan = [0] * len(rows)
    tokens, expected = base_tokens, base_expected
    fed = {row.network: 0.0 for row in rows if row.network is not None and row.max_drafts > 0}
    seconds = forward_s(tokens) + sum(network_s[key](0.0) for key in fed)
    while True:
        best = _best_extension(rows, plan, tokens, fed, forward_s, network_s)
        if best is None:
            return plan
        row, extra, gain, cost = best
        if gain * seconds <= expected * cost:
            return plan  # the best remaining extension would lower tokens per second; the rest are worse
        if rows[row].network is not None:
            fed[rows[row].network] += (rows[row].reads if plan[row] == 0 else 0.0) + extra
        plan[row] += extra
        tokens += extra
        expected += gain
        seconds += cost


def _best_extension(rows: list[RowDrafts], plan: list[int], tokens: int, fed: dict[Hashable, float],
                    forward_s: Callable[[int], float], network_s: NetworkSeconds
                    ) -> tuple[int, int, float, float] | None:
    """(row, extra drafts, gain, cost) of the extension with the most expected tokens per second, or None; a
    forward of ``tokens`` tokens and the shared passes fed ``fed`` ids are planned so far."""
    best: tuple[int, int, float, float] | None = None
    now = forward_s(tokens)
    for index, row in enumerate(rows):
        done = plan[index]
        gain, drafting = 0.0, row.pass_s if done == 0 and row.network is None else 0.0
        if row.network is not None:
            network, ids = network_s[row.network], fed[row.network]
            reads, passed = (row.reads if done == 0 else 0.0), network(ids)
        # once a row drafts, one more draft is its best extension (reach never grows with the position)
        last = row.max_drafts if done == 0 else min(done + 1, row.max_drafts)
        for position in range(done, last):
            extra = position + 1 - done
            gain += row.reach[position]
            if row.network is None:
                drafting += row.token_s
            else:
                drafting = network(ids + reads + extra) - passed
            cost = drafting + forward_s(tokens + extra) - now
            if (cost > 0 or gain > 0) and (best is None or gain * best[3] > best[2] * cost):  # cost 0: free
                best = (index, extra, gain, cost)
    return best
