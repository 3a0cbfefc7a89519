"""The DFlash block objective: anchors, the batch of blocks of one sequence, and the position-decayed loss.

Random *anchor* positions are drawn in a sequence's response; each anchor ``a`` forms a block
``[ids[a], MASK x (bs - 1)]`` at positions ``a .. a + bs - 1`` that sees only the context strictly before ``a``.
All blocks of a sequence go through ONE drafter forward: the context K/V are computed once and the blocks are
queries under a mask that is block-diagonal over the blocks and "before my anchor" over the context. Block
position ``j`` predicts ``ids[a + j]`` through the target's frozen head; position 0 has no loss; position
``j >= 1`` weighs ``exp(-(j - 1) / gamma)`` (a draft counts only if all before it were accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dflash2.drafters.dflash2_parts import selector_loss
from dflash2.drafters.dflash_model import DFlashDraftModel
from dflash2.models.decoder import Transformer


def default_gamma(block_size: int) -> float:
    """About 4 for block 8 and 7 for block 16 (the published settings), linear in between."""
    return 1.0 + 3.0 * block_size / 8.0


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[block_size] loss weight of each block position: 0 for position 0, exp(-(j - 1) / gamma) for j >= 1."""
    j = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(j - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass
class AnchorBatch:
    """All blocks of one sequence, flattened into Q = A * block_size queries."""

    input_ids: torch.Tensor  # [Q] int64: the anchor token, then mask ids
    positions: torch.Tensor  # [Q] int64: anchor + j
    labels: torch.Tensor  # [Q] int64: ids[anchor + j] (0 where there is none)
    weights: torch.Tensor  # [Q] float32: loss weight; 0 at position 0 and past the sequence's end
    attn_mask: torch.Tensor  # [1, Q, S + Q] bool over [context ; blocks]
    context_length: int  # S: context positions 0 .. S - 1 (= the last anchor)


def sample_anchors(prompt_length: int, length: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``count`` distinct sorted anchors in the response: a in [max(prompt_length, 1), length - 2].

    The anchor is the pending token of a decoding step, so the first one is the first response token; the last
    one still has a token to predict.
    """
    low, high = max(prompt_length, 1), length - 2
    if high < low:
        return torch.zeros(0, dtype=torch.int64)
    candidates = high - low + 1
    picked = torch.randperm(candidates, generator=generator)[: min(count, candidates)]
    return picked.sort().values + low


def build_anchor_batch(
    ids: torch.Tensor,  # [N] int64 the sequence
    anchors: torch.Tensor,  # [A] int64 sorted anchor positions, each in [1, N - 2]
    block_size: int,
    mask_token_id: int,
    weights_by_position: torch.Tensor,  # [block_size] float32 (position_weights)
) -> AnchorBatch:
    length, num_blocks = ids.shape[0], anchors.shape[0]
    j = torch.arange(block_size)
    positions = (anchors[:, None] + j).reshape(-1)  # [Q]
    input_ids = torch.full((num_blocks, block_size), mask_token_id, dtype=torch.int64)
    input_ids[:, 0] = ids[anchors]
    inside = positions < length  # [Q] a label exists
    labels = torch.where(inside, ids[positions.clamp(max=length - 1)], torch.zeros_like(positions))
    weights = weights_by_position.repeat(num_blocks) * inside
    context_length = int(anchors.max()) if num_blocks else 0
    block = torch.arange(num_blocks).repeat_interleave(block_size)  # [Q] block of each query
    sees_context = torch.arange(context_length)[None, :] < anchors[block][:, None]  # [Q, S] strictly before a
    sees_block = block[:, None] == block[None, :]  # [Q, Q] bidirectional inside its own block
    attn_mask = torch.cat([sees_context, sees_block], dim=1)[None]
    return AnchorBatch(input_ids.reshape(-1), positions, labels, weights, attn_mask, context_length)


def block_hidden(
    model: DFlashDraftModel, target: Transformer, taps: Sequence[torch.Tensor], batch: AnchorBatch
) -> torch.Tensor:
    """The drafter's final hidden states [Q, D] of every block in ``batch`` (one forward).

    taps: the target's tapped hidden states of the sequence, one [1, N, D] per target_layer_ids entry.
    """
    device, S = model.device, batch.context_length
    context = model.project_context([t[:, :S].to(device) for t in taps])  # [1, S, D]
    context_kv = model.context_kv(context, torch.arange(S, device=device)[None])
    embeds = model.embed(target, batch.input_ids[None].to(target.device))  # [1, Q, D]
    return model(embeds, batch.positions[None].to(device), context_kv, batch.attn_mask.to(device))[0]


def scored_rows(model: DFlashDraftModel, batch: AnchorBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """keep [Q] bool (a weighted label the head can score: inside the draft vocabulary) and the labels [Q] as
    indices of the head's rows (-1 outside the draft vocabulary)."""
    labels = model.draft_labels(batch.labels).cpu()
    return (batch.weights > 0) & (labels >= 0), labels


def block_loss(
    model: DFlashDraftModel, target: Transformer, taps: Sequence[torch.Tensor], batch: AnchorBatch
) -> torch.Tensor:
    """Weighted cross-entropy of the block predictions (rows without weight skip the head)."""
    hidden = block_hidden(model, target, taps, batch)
    keep, labels = scored_rows(model, batch)
    if not bool(keep.any()):
        return hidden.sum() * 0.0  # no label the head can score: a zero loss that still backpropagates
    kept_hidden = hidden[keep.to(hidden.device)]  # [Q', D]
    logits = model.draft_logits(target, kept_hidden)  # [Q', V']
    weights = batch.weights[keep].to(logits.device)
    kept_labels = labels[keep].to(logits.device)
    losses = F.cross_entropy(logits, kept_labels, reduction="none")
    loss = (losses * weights).sum() / weights.sum()
    if model.selector is not None:  # DFlash2: also learn to pick the true token among the top-K candidates
        previous = model.selector_rows(batch.labels.roll(1))[keep.to(model.device)]  # true token at j - 1
        loss = loss + selector_loss(model.selector, logits, kept_hidden, kept_labels, previous.to(logits.device),
                                    weights)
    return loss
