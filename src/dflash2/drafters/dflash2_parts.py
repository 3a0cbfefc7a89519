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


def best_paths(
    selector: PathSelector | None,
    logits: torch.Tensor,  # [k, V'] float32 drafter logits of block positions 1 .. k
    hidden: torch.Tensor,  # [k, D] drafter hidden states of those positions
    pending_row: int,  # codebook row of the pending token
    num_paths: int,
    top_k: int = 16,
) -> list[list[int]]:
    """Up to ``num_paths`` distinct paths of codebook rows through the candidate lattice, for a draft tree.

    The first path is the greedy one (the selector's walk, or the top-1 chain without a selector), so a tree of
    these paths always contains the chain draft. The others come from a beam search of width ``num_paths`` over
    the summed step log-probabilities: log-softmax over the K candidates of the pair scores S_t(a, .) after the
    previous choice a (DFlash2), or of the drafter logits alone (DFlash, whose positions are independent).
    """
    candidates, scores = candidate_lattice(selector, logits, hidden, pending_row, top_k)  # [k, K], [k, K, K]
    k, top = candidates.shape
    steps = F.log_softmax(scores.float(), dim=-1).tolist()  # [k][K][K] log P(choice j at t | choice i at t - 1)
    greedy = [0] + greedy_walk(scores)  # indices among the candidates, the pending token's row 0 first
    beams = [([0], 0.0)]  # (candidate indices with the predecessor first, summed log-probability)
    for t in range(k):
        expanded = [(path + [j], score + steps[t][path[-1]][j]) for path, score in beams for j in range(top)]
        beams = sorted(expanded, key=lambda beam: beam[1], reverse=True)[:num_paths]
    chosen = [greedy[1:]] + [path[1:] for path, _ in beams if path != greedy]
    return [[int(candidates[t, j]) for t, j in enumerate(path)] for path in chosen[:num_paths]]


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
