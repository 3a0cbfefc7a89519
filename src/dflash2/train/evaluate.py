"""The held-out acceptance check of a block drafter, and the target's hidden states it (and training) reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dflash2.drafters.dflash2_parts import select_path
from dflash2.drafters.dflash_model import DFlashDraftModel
from dflash2.models.decoder import Transformer
from dflash2.train.data import TrainingSequence
from dflash2.train.objective import block_hidden, build_anchor_batch, default_gamma, position_weights, scored_rows


@dataclass
class EvalResult:
    tau: float  # mean accepted length per block, the bonus/recovered token included (1.0 = nothing accepted)
    acceptance_by_position: list[float]  # [bs - 1] share of blocks whose draft j was accepted
    loss: float  # weighted block loss on the held-out sequences (labels inside the draft vocabulary)
    num_blocks: int


@torch.no_grad()
def target_pass(target: Transformer, ids: torch.Tensor, layers: Sequence[int], logits: bool = False):
    """One uncached causal target forward over ids [N]: taps (one [1, N, D] per layer) and optional logits."""
    return target(ids[None].to(target.device), hidden_layers=tuple(layers), logits="all" if logits else "none")


@torch.no_grad()
def evaluate_acceptance(
    model: DFlashDraftModel,
    target: Transformer,
    sequences: Sequence[TrainingSequence],
    anchors_per_sequence: int = 16,
    gamma: float | None = None,
) -> EvalResult:
    """Greedy drafts vs the target's greedy continuation on held-out sequences, blocks at evenly spaced anchors.

    Draft j of a block at anchor a is accepted while every draft before it was, it equals the target's argmax
    after ``ids[: a + j]``, and that argmax is also ``ids[a + j]`` (so the prefix the target conditioned on is
    the one the accepted drafts form).
    """
    config = model.config
    bs = config.block_size
    weights_by_position = position_weights(bs, gamma if gamma is not None else default_gamma(bs))
    accepted_counts: list[torch.Tensor] = []
    total_loss, loss_items = 0.0, 0
    was_training = model.training
    model.eval()
    for sequence in sequences:
        ids, length = sequence.ids, len(sequence.ids)
        low, high = max(sequence.prompt_length, 1), length - bs  # full blocks only
        if high < low:
            continue
        anchors = torch.linspace(low, high, steps=min(anchors_per_sequence, high - low + 1)).round().long().unique()
        out = target_pass(target, ids, config.target_layer_ids, logits=True)
        greedy = out.logits[0].argmax(dim=-1).cpu()  # [N] greedy[p] = the target's choice for position p + 1
        batch = build_anchor_batch(ids, anchors, bs, config.mask_token_id, weights_by_position)
        hidden = block_hidden(model, target, out.hidden_states, batch)
        logits = model.logits(target, hidden)  # [Q, V], -inf outside the draft vocabulary
        keep, _ = scored_rows(model, batch)  # the labels the head can score, as in training (others: -inf, inf loss)
        if bool(keep.any()):  # over the full vocabulary, the -inf columns add nothing: the draft-vocabulary loss
            device = logits.device
            losses = F.cross_entropy(logits[keep.to(device)], batch.labels[keep].to(device), reduction="none")
            total_loss += float((losses * batch.weights[keep].to(losses.device)).sum() / batch.weights[keep].sum())
            loss_items += 1
        drafts = greedy_block_drafts(model, target, hidden, logits, ids[anchors])  # [A, bs - 1]
        wanted = greedy[(anchors[:, None] + torch.arange(bs - 1))]  # [A, bs - 1] target choice for a + j
        follows = ids[anchors[:, None] + torch.arange(1, bs)] == wanted  # the data is the target's own choice
        hits = (drafts == wanted) & follows
        accepted_counts.append(hits.long().cumprod(dim=1).sum(dim=1))
    model.train(was_training)
    if not accepted_counts:
        return EvalResult(tau=1.0, acceptance_by_position=[0.0] * (bs - 1), loss=float("nan"), num_blocks=0)
    accepted = torch.cat(accepted_counts)  # [blocks]
    by_position = [(accepted >= j).float().mean().item() for j in range(1, bs)]
    return EvalResult(tau=1.0 + accepted.float().mean().item(), acceptance_by_position=by_position,
                      loss=total_loss / loss_items if loss_items else float("nan"), num_blocks=int(accepted.numel()))


def greedy_block_drafts(
    model: DFlashDraftModel,
    target: Transformer,
    hidden: torch.Tensor,  # [A * bs, D] drafter hidden states of A blocks
    logits: torch.Tensor,  # [A * bs, V] their logits over the full vocabulary
    pending: torch.Tensor,  # [A] int64 the token at each block's first position
) -> torch.Tensor:
    """[A, bs - 1] the drafts the drafter proposes at T = 0: the argmax chain, or DFlash2's selector walk."""
    bs = model.config.block_size
    if model.selector is None:
        return logits.argmax(dim=-1).cpu().view(-1, bs)[:, 1:]
    blocks = hidden.view(-1, bs, hidden.shape[-1])[:, 1:]  # [A, bs - 1, D]
    rows = model.selector_rows(pending.to(model.device)).tolist()
    drafts = []
    for block, pending_row in zip(blocks, rows):
        path = select_path(model.selector, model.draft_logits(target, block), block, pending_row, 0.0)
        drafts.append(path.rows if model.draft_vocab is None else model.draft_vocab[path.rows])
    return torch.stack(drafts).cpu()


def sequence_taps(
    target: Transformer, sequence: TrainingSequence, stored_layers: Sequence[int], layers: Sequence[int]
) -> tuple[torch.Tensor, ...]:
    """The target's hidden states of ``layers`` over the sequence, one [1, N or N - 1, D] each.

    Taken from the data when it stores them (hidden states captured while the target generated the sequence),
    otherwise computed by one target forward.
    """
    if sequence.hidden is not None and set(layers) <= set(stored_layers):
        return tuple(sequence.hidden[None, :, list(stored_layers).index(layer)] for layer in layers)
    return target_pass(target, sequence.ids, layers).hidden_states
