"""Draft trees over several PARD passes (``pard:L+kxW``): pass s + 1 knows pass s's top first draft (the lead
token), so the lead token's children come from it and every other node's from its own pass."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Candidates:
    """A pass's top candidates per draft position: ``rows[t][j]`` the head row of draft t + 1's j-th likeliest,
    ``log_p[t][j]`` its log-probability (softmax over the head's rows)."""

    rows: list[list[int]]
    log_p: list[list[float]]


def top_candidates(part: torch.Tensor, top_k: int = 8) -> Candidates:
    """[k, V'] float32 logits -> their top ``top_k`` candidates per position, likeliest first."""
    values, indices = torch.log_softmax(part.float(), dim=-1).topk(min(top_k, part.shape[-1]), dim=-1)  # [k, K]
    return Candidates(rows=indices.tolist(), log_p=values.tolist())


def lead_tree(passes: list[Candidates], num_nodes: int) -> tuple[list[int], list[int]]:
    """A best-first draft tree over the drafts of several passes: (head row of each node, parent of each node, -1 =
    child of the pending token); parents precede their children.

    ``passes[s]``: pass s's candidates for its drafts 1..k; pass s + 1 was fed pass s's top draft 1 (the lead
    token, ``rows[0][0]``). A node's children come from the next row of its own pass, except the lead
    token's, which come from the first row of the next pass (the drafts made knowing it). The chain of lead tokens
    and the last pass's top drafts comes first; the rest of the budget goes to the nodes of highest estimated
    probability (the product of each step's softmax probability, as :func:`best_tree` without a selector)."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    rows, log_p = [p.rows for p in passes], [p.log_p for p in passes]  # [pass][t][j]
    top, last = len(rows[0][0]), len(passes) - 1

    def children_row(s: int, t: int, j: int) -> tuple[int, int] | None:
        if s < last and t == 0 and j == 0:
            return s + 1, 0  # the lead token: its children were drafted knowing it
        return (s, t + 1) if t + 1 < len(rows[s]) else None

    nodes: list[tuple[int, int, int]] = []  # (pass s, row t, candidate j)
    parents: list[int] = []
    frontier: list[tuple[float, int, int, int, int, int]] = []  # (-log P, tie, s, t, j, parent): heapq's min first
    ties = itertools.count()

    def add(s: int, t: int, j: int, parent: int, log_prob: float, skip: int = -1) -> None:
        nodes.append((s, t, j))
        parents.append(parent)
        below = children_row(s, t, j)
        if below is not None:  # its children wait in the frontier (but the next chain node, added already)
            cs, ct = below
            for child in range(top):
                if child != skip:
                    heapq.heappush(frontier, (-(log_prob + log_p[cs][ct][child]), next(ties), cs, ct, child,
                                              len(nodes) - 1))

    for j in range(1, top):  # the other candidates for draft 1
        heapq.heappush(frontier, (-log_p[0][0][j], next(ties), 0, 0, j, -1))
    chain = [(s, 0) for s in range(last)] + [(last, t) for t in range(len(rows[last]))]
    log_prob = 0.0
    for s, t in chain[:num_nodes]:  # the top chain first: the tree accepts at least what it would
        log_prob += log_p[s][t][0]
        add(s, t, 0, len(nodes) - 1, log_prob, skip=0)
    while len(nodes) < num_nodes and frontier:
        negative, _, s, t, j, parent = heapq.heappop(frontier)
        add(s, t, j, parent, -negative)
    return [rows[s][t][j] for s, t, j in nodes], parents
