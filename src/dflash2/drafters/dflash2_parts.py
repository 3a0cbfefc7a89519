"""DFlash2's additions to the DFlash drafter: a candidate path selector and a two-tap dynamic convolution.

Path selector. The target's next token is usually among the drafter's top-K candidates even when it is not the
top-1, and which candidate fits depends on the token chosen before it. For block positions t = 1 .. k with
candidates c_t (top-K of the drafter logits U_t) every adjacent pair is scored

    S_t(a, b) = U_t(b) + < A(a) * H(h_t), B(b) >        a in c_(t-1) (c_0 = the pending token), b in c_t

with rank-R codebooks A, B over the draft vocabulary (one extra row for ids outside it) and H a projection of
the drafter's hidden state h_t. All pair scores come from one batched product; the path is then walked greedily
(T = 0) or sampled from softmax(S / T) over the K candidates, whose sparse distribution is the q_draft that
rejection sampling needs. H starts at zero, so an untrained selector picks the top-1 chain (plain DFlash).

Dynamic convolution. Around each attention and MLP sublayer the normed input goes through
x_t -> k0_t * x_t + k1_t * x_(t-1), with taps computed from x_t and shared by each group of channels; x_(t-1) is
zero at a block's first position. The taps start at (1, 0): an identity that training moves away from.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class DynamicConv(nn.Module):
    """Two-tap, content-dependent depthwise convolution along a block, taps shared per channel group."""

    def __init__(self, width: int, group: int, block_size: int) -> None:
        super().__init__()
        if width % group:
            raise ValueError(f"width {width} is not a multiple of the channel group {group}")
        self.group, self.block_size = group, block_size
        self.taps = nn.Linear(width, 2 * (width // group))  # -> (k0 - 1, k1) per group
        nn.init.zeros_(self.taps.weight)
        nn.init.zeros_(self.taps.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, D], blocks of block_size laid end to end
        batch, length, width = x.shape
        groups = width // self.group
        taps = self.taps(x).view(batch, length, 2, groups)  # [B, T, 2, G]
        previous = torch.cat([x.new_zeros(batch, 1, width), x[:, :-1]], dim=1)  # [B, T, D] x_(t-1)
        block_start = torch.arange(length, device=x.device) % self.block_size == 0  # [T]
        previous = previous.masked_fill(block_start[None, :, None], 0.0)
        grouped = x.view(batch, length, groups, self.group)
        mixed = grouped * (1.0 + taps[:, :, 0, :, None]) + previous.view_as(grouped) * taps[:, :, 1, :, None]
        return mixed.view(batch, length, width)


class PathSelector(nn.Module):
    """Low-rank pair scores over the drafter's top-K candidates (see the module docstring)."""

    def __init__(self, vocab_rows: int, width: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.prev_codes = nn.Embedding(vocab_rows + 1, rank)  # A; the last row stands for ids outside the vocab
        self.next_codes = nn.Embedding(vocab_rows + 1, rank)  # B
        self.gate = nn.Linear(width, rank, bias=False)  # H
        nn.init.normal_(self.prev_codes.weight, std=0.02)
        nn.init.normal_(self.next_codes.weight, std=0.02)
        nn.init.zeros_(self.gate.weight)

    @property
    def outside(self) -> int:
        """The codebook row of every id outside the draft vocabulary."""
        return self.prev_codes.num_embeddings - 1

    def pair_scores(
        self,
        previous: torch.Tensor,  # [T, Ka] int64 codebook rows of the previous position's candidates
        candidates: torch.Tensor,  # [T, K] int64 codebook rows of this position's candidates
        candidate_logits: torch.Tensor,  # [T, K] float32 drafter logits U_t of the candidates
        hidden: torch.Tensor,  # [T, D] drafter hidden states h_t
    ) -> torch.Tensor:
        """S [T, Ka, K]: S[t, i, j] = U_t(candidates[t, j]) + <A(previous[t, i]) * H(h_t), B(candidates[t, j])>."""
        gate = self.gate(hidden.to(self.gate.weight.dtype))  # [T, R]
        left = self.prev_codes(previous) * gate[:, None, :]  # [T, Ka, R]
        right = self.next_codes(candidates)  # [T, K, R]
        return candidate_logits[:, None, :] + torch.bmm(left, right.transpose(1, 2)).float()


@dataclass
class SelectedPath:
    rows: torch.Tensor  # [k] int64 chosen codebook rows (draft-vocabulary indices)
    q: torch.Tensor | None  # [k, K] float32 the distribution each choice was sampled from (None when greedy)
    candidates: torch.Tensor  # [k, K] int64 codebook rows of the candidates


def candidate_lattice(
    selector: PathSelector | None,
    logits: torch.Tensor,  # [k, V'] float32 drafter logits of block positions 1 .. k (V' = draft vocabulary)
    hidden: torch.Tensor,  # [k, D] drafter hidden states of those positions
    pending_row: int,  # codebook row of the pending token (selector.outside when it is not in the vocabulary)
    top_k: int = 16,  # candidates per position without a selector (a selector brings its own)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(candidates [k, K] codebook rows, scores [k, K, K]): scores[t, i, j] scores candidate j at position t
    after candidate i at t - 1 (row 0 of position 1 stands for the pending token). Every pair score comes from
    one batched product; without a selector (DFlash) every row is the drafter logits (independent positions)."""
    k = logits.shape[0]
    top = min(selector.top_k if selector is not None else top_k, logits.shape[-1])
    candidate_logits, candidates = logits.topk(top, dim=-1)  # [k, K]
    if selector is None:
        return candidates, candidate_logits[:, None, :].expand(k, top, top)
    previous = torch.cat([torch.full((1, top), pending_row, dtype=torch.int64, device=candidates.device),
                          candidates[:-1]])  # [k, K]; position 1's only real predecessor is the pending token
    return candidates, selector.pair_scores(previous, candidates, candidate_logits, hidden)


def greedy_walk(scores: torch.Tensor) -> list[int]:
    """Candidate indices [k] of the greedy path through pair scores [k, K, K] (from row 0 of position 1)."""
    chosen = [0]
    for t in range(scores.shape[0]):
        chosen.append(int(scores[t, chosen[-1]].argmax()))
    return chosen[1:]


def select_path(
    selector: PathSelector,
    logits: torch.Tensor,  # [k, V'] float32 drafter logits of block positions 1 .. k (V' = draft vocabulary)
    hidden: torch.Tensor,  # [k, D] drafter hidden states of those positions
    pending_row: int,  # codebook row of the pending token (selector.outside when it is not in the vocabulary)
    temperature: float,  # 0 = greedy walk
    generator: torch.Generator | None = None,
) -> SelectedPath:
    """Walk the candidate lattice greedily (T = 0), or sample each step from softmax(S / T) over the K
    candidates after the previous choice (q: those sparse distributions, for rejection sampling)."""
    candidates, scores = candidate_lattice(selector, logits, hidden, pending_row)  # [k, K], [k, K, K]
    k, top = candidates.shape
    if temperature <= 0:
        path = torch.tensor(greedy_walk(scores), dtype=torch.int64, device=candidates.device)  # [k]
        return SelectedPath(rows=candidates.gather(1, path[:, None])[:, 0], q=None, candidates=candidates)
    rows = torch.empty(k, dtype=torch.int64, device=candidates.device)
    q = torch.empty(k, top, device=scores.device)
    chosen = 0  # index of the previous choice among its candidates (row 0 of position 1 is the pending token)
    for t in range(k):
        q[t] = F.softmax(scores[t, chosen] / temperature, dim=-1)
        chosen = int(torch.multinomial(q[t], 1, generator=generator))
        rows[t] = candidates[t, chosen]
    return SelectedPath(rows=rows, q=q, candidates=candidates)


def best_tree(
    selector: PathSelector | None,
    logits: torch.Tensor,  # [k, V'] float32 drafter logits of block positions 1 .. k (V' = draft vocabulary)
    hidden: torch.Tensor,  # [k, D] drafter hidden states of those positions
    pending_row: int,  # codebook row of the pending token
    num_nodes: int,
    top_k: int = 16,
) -> tuple[list[int], list[int]]:
    """A draft tree of at most ``num_nodes`` nodes and depth k through the candidate lattice: (codebook row of
    each node, parent of each node, -1 = child of the pending token); parents precede their children.

    The chain draft (the selector's greedy walk, or the top-1 chain without a selector) comes first, so the tree
    accepts at least what the chain would. The rest of the budget goes to the nodes of highest estimated
    acceptance probability (best-first, as in EAGLE-2's dynamic trees): a node's probability is the product of
    its steps' P(choice | previous choice) = softmax over the K candidates of the pair scores after the previous
    choice (DFlash2; the drafter logits alone for DFlash), times the drafter's probability mass on those K.
    A child is never likelier than its parent, so the best nodes always form a tree.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    candidates, scores = candidate_lattice(selector, logits, hidden, pending_row, top_k)  # [k, K], [k, K, K]
    k, top = candidates.shape
    full = logits.float().logsumexp(dim=-1)  # [k]
    mass = logits.float().gather(1, candidates).logsumexp(dim=-1) - full  # [k] log P(one of the K candidates)
    steps = (F.log_softmax(scores.float(), dim=-1) + mass[:, None, None]).tolist()  # [k][K][K]
    chain = greedy_walk(scores)  # [k] candidate indices
    nodes: list[tuple[int, int]] = []  # (block position t, candidate index j) of each node
    parents: list[int] = []
    frontier: list[tuple[float, int, int, int, int]] = []  # (-log P, tie, t, j, parent node): heapq's min first

    def add(t: int, j: int, parent: int, log_p: float, skip: int = -1) -> None:
        nodes.append((t, j))
        parents.append(parent)
        if t + 1 < k:  # its children wait in the frontier (but the next chain node, added already)
            node = len(nodes) - 1
            for child in range(top):
                if child != skip:
                    heapq.heappush(frontier, (-(log_p + steps[t + 1][j][child]), len(nodes) * top + child,
                                              t + 1, child, node))

    for root in range(top):
        if root != chain[0]:
            heapq.heappush(frontier, (-steps[0][0][root], root, 0, root, -1))
    log_p = 0.0
    for t, j in enumerate(chain[:num_nodes]):
        log_p += steps[t][chain[t - 1] if t else 0][j]
        add(t, j, t - 1, log_p, chain[t + 1] if t + 1 < k else -1)
    while len(nodes) < num_nodes and frontier:
        negative, _, t, j, parent = heapq.heappop(frontier)
        add(t, j, parent, -negative)
    return [int(candidates[t, j]) for t, j in nodes], parents


def selector_loss(
    selector: PathSelector,
    logits: torch.Tensor,  # [Q, V'] drafter logits of block positions (Q = blocks * block_size)
    hidden: torch.Tensor,  # [Q, D]
    labels: torch.Tensor,  # [Q] int64 draft-vocabulary row of the target's token at each position (-1: outside)
    previous_labels: torch.Tensor,  # [Q] int64 row of the true previous token (selector.outside when unknown)
    weights: torch.Tensor,  # [Q] float32 position weights (0 where there is no loss)
) -> torch.Tensor:
    """Cross-entropy of the true token among the top-K candidates, scored after the true previous token.

    Positions whose true token is not a candidate carry no selector loss (the DFlash loss covers them).
    """
    top = min(selector.top_k, logits.shape[-1])
    candidate_logits, candidates = logits.detach().topk(top, dim=-1)  # [Q, K]
    hit = candidates == labels[:, None]  # [Q, K]
    keep = (weights > 0) & hit.any(dim=-1)
    if not bool(keep.any()):
        return hidden.sum() * 0.0
    scores = selector.pair_scores(previous_labels[keep, None], candidates[keep], candidate_logits[keep],
                                  hidden[keep])[:, 0]  # [Q', K]
    target = hit[keep].float().argmax(dim=-1)  # [Q'] index of the true token among the candidates
    losses = F.cross_entropy(scores, target, reduction="none")
    return (losses * weights[keep]).sum() / weights[keep].sum()
