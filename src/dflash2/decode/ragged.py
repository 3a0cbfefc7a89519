"""One target forward over a ragged batch: rows of different lengths (a prompt, a pending token plus k drafts,
a lone pending token) over a paged KV cache.

The projections and the feed-forward run on the N real tokens flattened (no padding there); only attention
pads, to ``[B, T_max]`` queries over ``[B, S_max]`` gathered keys, with a mask that gives each query its own
row's cached slots and the row's new tokens up to itself (a chain). Uses the target's own modules, so the math
is the decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.kv.paged import BlockTable, PagedKVPool
from dflash2.models.attention import attend
from dflash2.models.decoder import Transformer, rotate_half


@dataclass
class RaggedRow:
    table: BlockTable  # the row's KV blocks; its new tokens are written at [table.length, table.length + T)
    tokens: list[int]  # [T] new input ids (T >= 1)
    all_logits: bool  # True: logits of every new token (verification); False: of the last one only (prefill)


@dataclass
class RaggedLayout:
    """Index tensors of one ragged forward, built once and shared by every layer."""

    input_ids: torch.Tensor  # [N] int64, the rows' new tokens concatenated
    positions: torch.Tensor  # [N] int64
    write_slots: torch.Tensor  # [N] int64, the pool slot each new token's keys/values go to
    query_index: torch.Tensor  # [B, T_max] int64, flat index of row r's i-th new token (padding: 0)
    query_valid: torch.Tensor  # [B, T_max] bool
    key_slots: torch.Tensor  # [B, S_max] int64, pool slots of row r's visible keys (padding: 0)
    mask: torch.Tensor  # [B, 1, T_max, S_max] bool, True = may attend
    logit_index: torch.Tensor  # [M] int64, flat indices whose logits are returned
    logit_rows: list[tuple[int, int]]  # per row: [start, end) of its logits in the [M] result


def build_layout(rows: list[RaggedRow], device: torch.device) -> RaggedLayout:
    lengths = [len(row.tokens) for row in rows]
    spans = [row.table.length + n for row, n in zip(rows, lengths)]  # visible slots per row
    t_max, s_max = max(lengths), max(spans)
    batch = len(rows)
    query_index = torch.zeros(batch, t_max, dtype=torch.int64)
    key_slots = torch.zeros(batch, s_max, dtype=torch.int64)
    mask = torch.zeros(batch, 1, t_max, s_max, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # padded queries see one slot (their output is dropped) so softmax stays finite
    ids, positions, writes, logit_index, logit_rows = [], [], [], [], []
    flat = 0
    for r, (row, n, span) in enumerate(zip(rows, lengths, spans)):
        start = row.table.length
        ids.extend(row.tokens)
        positions.extend(range(start, span))
        key_slots[r, :span] = row.table.slots(0, span)
        writes.append(key_slots[r, start:span])
        query_index[r, :n] = torch.arange(flat, flat + n)
        causal = torch.arange(span)[None, :] <= torch.arange(start, span)[:, None]  # [n, span]
        mask[r, 0, :n, :span] = causal
        first = flat if row.all_logits else flat + n - 1
        logit_rows.append((len(logit_index), len(logit_index) + flat + n - first))
        logit_index.extend(range(first, flat + n))
        flat += n
    valid = torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]  # [B, T_max]
    return RaggedLayout(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        write_slots=torch.cat(writes).to(device),
        query_index=query_index.to(device),
        query_valid=valid.to(device),
        key_slots=key_slots.to(device),
        mask=mask.to(device),
        logit_index=torch.tensor(logit_index, device=device),
        logit_rows=logit_rows,
    )


@dataclass
class RaggedOutput:
    logits: list[torch.Tensor]  # per row float32 [T or 1, V]
    hidden: list[dict[int, torch.Tensor]]  # per row: tapped layer -> [1, T, D] hidden states of its new tokens


@torch.inference_mode()
def ragged_forward(model: Transformer, pool: PagedKVPool, rows: list[RaggedRow],
                   hidden_layers: tuple[int, ...] = ()) -> RaggedOutput:
    """Write every row's new tokens into the pool; return per row its logits and the hidden states (outputs of
    the decoder layers ``hidden_layers``) of its new tokens.

    The rows' ``table.length`` is not moved: the caller commits (rolls back to) the slots it keeps.
    """
    layout = build_layout(rows, model.device)
    cos, sin = model.rope(layout.positions[None])  # [1, 1, N, Dh] each
    cos, sin = cos[0, 0, :, None], sin[0, 0, :, None]  # [N, 1, Dh]
    x = model.embed(layout.input_ids)[None]  # [1, N, D]
    taps: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        x = x + _attention(layer.attn, layer.attn_norm(x), cos, sin, pool, index, layout)
        x = x + layer.ffn(layer.ffn_norm(x))
        if index in hidden_layers:
            taps[index] = x  # [1, N, D]
    logits = model.lm_head(model.norm(x[0, layout.logit_index])).float()  # [M, V]
    bounds = torch.tensor([0, *(len(row.tokens) for row in rows)]).cumsum(0).tolist()
    hidden = [{layer: t[:, bounds[r] : bounds[r + 1]] for layer, t in taps.items()} for r in range(len(rows))]
    return RaggedOutput([logits[start:end] for start, end in layout.logit_rows], hidden)


def _attention(attn, h: torch.Tensor, cos, sin, pool: PagedKVPool, layer: int, layout: RaggedLayout) -> torch.Tensor:
    """h [1, N, D] normed inputs -> attention output [1, N, D]; writes this layer's new keys/values."""
    num = h.shape[1]
    q, k, v = attn.wqkv(h)[0].split(attn.split_sizes, dim=-1)
    q = q.view(num, attn.num_heads, attn.head_dim)  # [N, H, Dh]
    k = k.view(num, attn.num_kv_heads, attn.head_dim)  # [N, H_kv, Dh]
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    pool.keys[layer].index_copy_(0, layout.write_slots, k)
    pool.values[layer].index_copy_(0, layout.write_slots, v.view(num, attn.num_kv_heads, attn.head_dim))
    keys = _gather(pool.keys[layer], layout.key_slots)  # [B, H_kv, S_max, Dh]
    values = _gather(pool.values[layer], layout.key_slots)  # [B, H_kv, S_max, Dh]
    queries = _gather(q, layout.query_index)  # [B, H, T_max, Dh]
    out = attend(queries, keys, values, layout.mask)  # [B, H, T_max, Dh]
    out = out.transpose(1, 2)[layout.query_valid]  # [N, H, Dh], rows concatenated in order
    return attn.wo(out.reshape(1, num, -1))


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [R, H, Dh], index [B, S] -> [B, H, S, Dh] (index_select: no parallel region for small copies)."""
    batch, span = index.shape
    return rows.index_select(0, index.reshape(-1)).view(batch, span, *rows.shape[1:]).transpose(1, 2)
