"""The PARD objective: blocks of [real token, k - 1 masks] at many anchors of a sequence, in one forward.

A block anchored at ``a`` (the pending token of a decoding step) is ``[ids[a], MASK x d]`` at positions
``a .. a + d``; row j predicts ``ids[a + j + 1]`` (row 0 is the ordinary next-token prediction, draft 1; row j the
mask's draft j + 1). Each block sees the context strictly before ``a`` and its own earlier rows (causal, as in a
draft pass). The context's keys/values are computed once per sequence, without gradients (the adapted network
runs them, but the loss reaches the weights through the block rows only: about half the cost of the exact
gradient on these cores), except with the exact gradient (``exact``) or where the target conditioning reads every
context position (``ConditioningConfig.context``): then the context pass keeps its gradient (and carries the
offsets).

Conditional drop (PARD's token dropping): every anchor keeps row 0; row j + 1 of a block is kept only when row j
was and a coin with ``keep_ratio`` says so, so deep rows are trained on fewer anchors and a sequence costs about
``1 / (1 - keep_ratio)`` rows per anchor instead of k.

Labels are soft: the target's stored top-k distribution at the row's position (``dflash2.train.labels``), the
mass outside the top-k as one "other" bucket (distillation), plus ``ce_weight`` x cross-entropy on the real next
token. Row j weighs ``decay^j`` times the probability that the target reaches it: the product of the target's
probabilities of the real tokens ``ids[a + 1 .. a + j]`` (PARD-2's per-position weight; 0 when a real token lies
outside the stored top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash2.drafters.kv_conditioning import GatedKVConditioning
from dflash2.models.decoder import CachedAttention, Transformer
from dflash2.train.labels import LabelledText


@dataclass
class PardBatch:
    """All blocks of one sequence, flattened into Q rows."""

    input_ids: torch.Tensor  # [Q] int64: ids[a] at row 0 of a block, the mask id after it
    positions: torch.Tensor  # [Q] int64: a + j
    label_rows: torch.Tensor  # [Q] int64: index of position a + j among the sequence's label rows
    depth: torch.Tensor  # [Q] int64: j (0 = the anchor's own row)
    attn_mask: torch.Tensor  # [1, Q, S + Q] bool over [context slots 0 .. S - 1 ; block rows]
    context_length: int  # S = the last anchor (context slots are positions 0 .. S - 1)


def sample_blocks(label_start: int, num_rows: int, num_anchors: int, max_depth: int, keep_ratio: float,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [A] sorted, depths [A]): anchors drawn among the labelled positions; depth d_a <= max_depth mask
    rows, each further row kept with probability ``keep_ratio`` (conditional drop), never past the last label."""
    last = label_start + num_rows - 1  # the last labelled position
    candidates = num_rows
    if candidates <= 0:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    picked = torch.randperm(candidates, generator=generator)[: min(num_anchors, candidates)]
    anchors = picked.sort().values + label_start
    coins = torch.rand((len(anchors), max_depth), generator=generator) < keep_ratio  # [A, max_depth]
    depths = coins.long().cumprod(dim=1).sum(dim=1)
    return anchors, torch.minimum(depths, last - anchors)


def build_pard_batch(label_start: int, ids: torch.Tensor, anchors: torch.Tensor, depths: torch.Tensor,
                     mask_token_id: int) -> PardBatch:
    """The rows and attention mask of the blocks (anchors [A], depths [A]) of the sequence ids [N]."""
    lengths = depths + 1  # [A] rows per block
    block = torch.repeat_interleave(torch.arange(len(anchors)), lengths)  # [Q] block of each row
    first_row = torch.cumsum(lengths, 0) - lengths  # [A]
    depth = torch.arange(int(lengths.sum())) - first_row[block]  # [Q]
    positions = anchors[block] + depth
    input_ids = torch.where(depth == 0, ids[anchors[block]], torch.full_like(depth, mask_token_id))
    context_length = int(anchors.max()) if len(anchors) else 0
    sees_context = torch.arange(context_length)[None, :] < anchors[block][:, None]  # [Q, S] strictly before a
    same_block = block[:, None] == block[None, :]
    sees_block = same_block & (depth[None, :] <= depth[:, None])  # [Q, Q] causal inside its own block
    attn_mask = torch.cat([sees_context, sees_block], dim=1)[None]
    return PardBatch(input_ids, positions, positions - label_start, depth, attn_mask, context_length)


class FrozenContext:
    """Keys/values of a context, read-only: a pass with it attends to them and its own rows, and writes nothing
    (the decoder's ``cache`` protocol: ``length``, ``write``, ``advance``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys  # [L, 1, H_kv, S, Dh]
        self.values = values  # [L, 1, H_kv, S, Dh]
        self.length = keys.shape[3]

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.keys[layer], keys], dim=2), torch.cat([self.values[layer], values], dim=2)

    def advance(self, num_tokens: int) -> None:
        pass


def block_offsets(conditioning, text: LabelledText, batch: PardBatch) -> torch.Tensor | None:
    """[Q, D] each block row's input offset: the conditioning of the target's taps at the position before the
    block's anchor (the last position the target has verified when the anchor is the pending token); None
    without conditioning (``drafters/conditioning.py``)."""
    if conditioning is None:
        return None
    anchors = batch.positions - batch.depth  # [Q]
    return conditioning(text.taps[(anchors - 1).clamp_min(0)])


class RecordingContext:
    """An empty cache that keeps each layer's keys / values of one pass as computed (the autograd graph intact), so
    a block pass attending to them trains the context pass too."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # each [1, H_kv, S, Dh]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def frozen(self) -> FrozenContext:
        return FrozenContext(torch.stack(self.keys), torch.stack(self.values))


def context_offsets(conditioning, text: LabelledText, length: int) -> torch.Tensor | None:
    """[S, D] the input offsets of the context rows 0 .. S - 1 where the conditioning reads every position
    (``config.context``): row i gets the conditioning of the target's taps at i - 1, row 0 none; else None."""
    if conditioning is None or not conditioning.config.context or length == 0:
        return None
    offsets = conditioning(text.taps[: length - 1])  # [S - 1, D]
    return torch.cat([offsets.new_zeros(1, offsets.shape[-1]), offsets])


def block_hidden(model: Transformer, ids: torch.Tensor, batch: PardBatch, offsets: torch.Tensor | None = None,
                 context_offsets: torch.Tensor | None = None, exact: bool = False,
                 target_kv: tuple[GatedKVConditioning, torch.Tensor] | None = None) -> torch.Tensor:
    """[Q, D] final hidden states (before the norm) of every block row. ``offsets`` [Q, D]: added to the block
    rows' input embeddings (target conditioning); ``context_offsets`` [S, D]: to the context rows'. The context's
    keys / values are computed without gradients (the loss reaches the weights through the block rows only: about
    half the cost of the exact gradient on these cores) unless ``exact`` or ``context_offsets`` (the conditioning
    of every position learns only through the context pass) asks for the gradient through the context too.
    ``target_kv`` (conditioning, taps [N, T * Dt]): the block rows also look up the target's states at the context
    positions they see, through gated keys / values (``drafters/kv_conditioning.py``)."""
    device, S = model.device, batch.context_length
    offsets_in = None if context_offsets is None else context_offsets[None].to(device)  # [1, S, D]
    if (exact or offsets_in is not None) and S and torch.is_grad_enabled():
        recorder = RecordingContext(model.config.num_layers)
        model(ids[None, :S].to(device), cache=recorder, logits="none", input_offsets=offsets_in)
        context = recorder.frozen()
    else:
        with torch.no_grad():
            cache = model.new_cache(max(S, 1))
            if S:
                model(ids[None, :S].to(device), cache=cache, logits="none", input_offsets=offsets_in)
        context = FrozenContext(cache.keys[:, :, :, :S], cache.values[:, :, :, :S])
    last = model.config.num_layers - 1
    attention = CachedAttention(context, batch.attn_mask[:, None].to(device))  # [1, 1, Q, S + Q]
    if target_kv is not None:
        conditioning, taps = target_kv
        attention = conditioning.attention(model, attention, taps[:S].to(device), torch.arange(S, device=device),
                                           batch.attn_mask[:, :, :S].to(device))
    out = model(batch.input_ids[None].to(device), batch.positions[None].to(device), context=attention,
                hidden_layers=(last,), logits="none", input_offsets=None if offsets is None else offsets[None].to(device))
    return out.hidden_states[0][0]


def row_weights(text: LabelledText, batch: PardBatch, decay: float, reach: bool = True) -> torch.Tensor:
    """[Q] loss weight of each row: decay^j, times the target's probability of the real tokens before it."""
    weights = decay ** batch.depth.float()
    if not reach:
        return weights
    # p_real[r]: the target's probability of the real next token at label row r (0 outside the top-k)
    next_ids = text.ids[text.label_start + 1 : text.label_start + 1 + text.topk_ids.shape[0]]  # [R]
    p_real = (text.topk_probs * (text.topk_ids == next_ids[:, None])).sum(-1)  # [R]
    log_p = torch.log(p_real.clamp_min(1e-30))
    cum = torch.cat([torch.zeros(1), torch.cumsum(log_p, 0)])  # cum[r] = sum of log_p[:r]
    anchor_rows = batch.label_rows - batch.depth
    reach_prob = torch.exp(cum[batch.label_rows] - cum[anchor_rows])  # prod of p_real over rows a .. a + j - 1
    return weights * reach_prob


def distill_loss(logits: torch.Tensor, topk_ids: torch.Tensor, topk_probs: torch.Tensor, rest: torch.Tensor,
                 real_ids: torch.Tensor, weights: torch.Tensor, ce_weight: float) -> torch.Tensor:
    """Weighted mean over rows of: soft cross-entropy to (top-k, "other" bucket) + ce_weight x CE(real id).

    logits [r, V] float32, topk_ids/probs [r, K], rest [r], real_ids [r], weights [r].
    """
    log_q = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
    log_q_top = log_q.gather(1, topk_ids)  # [r, K]
    q_other = (1.0 - log_q_top.exp().sum(-1)).clamp_min(1e-6)  # [r]
    soft = -(topk_probs * log_q_top).sum(-1) - rest * torch.log(q_other)  # [r]
    hard = -log_q.gather(1, real_ids[:, None]).squeeze(1)  # [r]
    per_row = soft + ce_weight * hard
    return (per_row * weights).sum() / weights.sum().clamp_min(1e-12)


def conditioned_hidden(model: Transformer, text: LabelledText, batch: PardBatch, conditioning=None,
                       exact: bool = False) -> torch.Tensor:
    """:func:`block_hidden` of a labelled text's blocks with the conditioning's offsets (the drafting rows', and the
    context rows' where it reads every position), or its gated keys / values."""
    if isinstance(conditioning, GatedKVConditioning):
        return block_hidden(model, text.ids, batch, exact=exact, target_kv=(conditioning, text.taps))
    return block_hidden(model, text.ids, batch, block_offsets(conditioning, text, batch),
                        context_offsets(conditioning, text, batch.context_length), exact)


def pard_loss(model: Transformer, text: LabelledText, batch: PardBatch, *, decay: float, ce_weight: float,
              reach: bool = True, conditioning=None, exact: bool = False) -> tuple[torch.Tensor, int]:
    """(loss, rows scored) of one sequence's blocks; rows of zero weight skip the head; ``exact``: the gradient
    through the context pass too (:func:`block_hidden`)."""
    weights = row_weights(text, batch, decay, reach)
    keep = weights > 0
    hidden = conditioned_hidden(model, text, batch, conditioning, exact)
    if not bool(keep.any()):
        return hidden.sum() * 0.0, 0
    rows = batch.label_rows[keep]
    logits = model.lm_head(model.norm(hidden[keep.to(hidden.device)])).float()  # [r, V]
    device = logits.device
    loss = distill_loss(logits, text.topk_ids[rows].to(device), text.topk_probs[rows].to(device),
                        text.rest[rows].to(device), text.ids[batch.positions[keep] + 1].to(device),
                        weights[keep].to(device), ce_weight)
    return loss, int(keep.sum())


@torch.no_grad()
def heldout_acceptance(model: Transformer, texts, num_draft_tokens: int, mask_token_id: int,
                       anchors_per_sequence: int = 8, conditioning=None) -> tuple[float, list[float], int]:
    """Greedy drafts vs the target's greedy choice on held-out labelled sequences: (tau, acceptance by position
    [k], blocks). Draft j of a block at anchor a is accepted while every draft before it was, it equals the
    target's argmax at position a + j, and so does the real token ``ids[a + j + 1]`` (the data follows the
    target there, so the prefix the target conditioned on is the one the accepted drafts form)."""
    k = num_draft_tokens
    counts = []
    was_training = model.training
    model.eval()
    for text in texts:
        num_rows = text.topk_ids.shape[0]
        high = text.label_start + num_rows - k  # blocks with every row labelled
        if high < text.label_start:
            continue
        count = min(anchors_per_sequence, high - text.label_start + 1)
        anchors = torch.linspace(text.label_start, high, steps=count).round().long().unique()
        depths = torch.full_like(anchors, k - 1)
        batch = build_pard_batch(text.label_start, text.ids, anchors, depths, mask_token_id)
        hidden = conditioned_hidden(model, text, batch, conditioning)
        logits = model.lm_head(model.norm(hidden)).float()
        logits[:, mask_token_id] = float("-inf")
        drafts = logits.argmax(-1).cpu().view(-1, k)  # [A, k]
        greedy = text.topk_ids[batch.label_rows, 0].view(-1, k)  # [A, k] the target's choice at a + j
        follows = text.ids[batch.positions + 1].view(-1, k) == greedy
        hits = (drafts == greedy) & follows
        counts.append(hits.long().cumprod(dim=1).sum(dim=1))
    model.train(was_training)
    if not counts:
        return 1.0, [0.0] * k, 0
    accepted = torch.cat(counts)
    by_position = [(accepted >= j).float().mean().item() for j in range(1, k + 1)]
    return 1.0 + accepted.float().mean().item(), by_position, int(accepted.numel())
