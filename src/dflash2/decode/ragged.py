"""One target forward over a ragged batch: rows of different lengths (a prompt, a pending token plus k drafts or
a tree of drafts, a lone pending token) over a paged KV cache.

The decoder's own forward runs over the N real tokens flattened (no padding in projections and feed-forward);
only attention pads, to ``[B, T_max]`` queries over ``[B, S_max]`` gathered keys, with a mask that gives each
query its own row's cached slots and the row's new tokens up to itself (a chain) or its ancestors (a tree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.kv.paged import BlockTable, PagedKVPool
from dflash2.models.attention import attend
from dflash2.models.decoder import Transformer
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask


@dataclass
class RaggedRow:
    table: BlockTable  # the row's KV blocks; its new tokens are written at [table.length, table.length + T)
    tokens: list[int]  # [T] new input ids (T >= 1)
    all_logits: bool  # True: logits of every new token (verification); False: of the last one only (prefill)
    parents: list[int] | None = None  # a tree over tokens[1:] (tokens[0] is the pending token); None = a chain


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
        key_slots[r, :span] = row.table.slots(0, span)
        writes.append(key_slots[r, start:span])
        query_index[r, :n] = torch.arange(flat, flat + n)
        if row.parents is None:
            positions.extend(range(start, span))
            mask[r, 0, :n, :span] = torch.arange(span)[None, :] <= torch.arange(start, span)[:, None]  # causal
        else:  # each node sees the cached slots, the pending token and its ancestors; position = start + depth
            tree = compile_tree(row.parents)
            positions.extend(target_positions(tree, start).tolist())
            mask[r, 0, :n, :span] = tree_attention_mask(tree, start)
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
    the decoder layers ``hidden_layers``) of its new tokens. The decoder's own forward runs over the N real
    tokens as one sequence; only its attention is ragged (:class:`RaggedAttention`).

    The rows' ``table.length`` is not moved: the caller commits (rolls back to) the slots it keeps.
    """
    layout = build_layout(rows, model.device)
    out = model(layout.input_ids[None], positions=layout.positions[None], hidden_layers=hidden_layers,
                logits=layout.logit_index, context=RaggedAttention(pool, layout))
    logits = out.logits[0]  # [M, V]
    taps = dict(zip(hidden_layers, out.hidden_states))  # layer -> [1, N, D]
    bounds = torch.tensor([0, *(len(row.tokens) for row in rows)]).cumsum(0).tolist()
    hidden = [{layer: t[:, bounds[r] : bounds[r + 1]] for layer, t in taps.items()} for r in range(len(rows))]
    return RaggedOutput([logits[start:end] for start, end in layout.logit_rows], hidden)


class RaggedAttention:
    """The decoder's attention over a ragged batch: new keys/values go to the rows' pool slots; each row's
    queries attend, padded to ``[B, T_max]``, to its own visible slots gathered from the pool (``[B, S_max]``)."""

    def __init__(self, pool: PagedKVPool, layout: RaggedLayout) -> None:
        self.pool, self.layout = pool, layout

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [1, H, N, Dh], k / v [1, H_kv, N, Dh] over the N real tokens -> [1, H, N, Dh]."""
        layout, pool = self.layout, self.pool
        pool.keys[layer].index_copy_(0, layout.write_slots, k[0].transpose(0, 1))  # [N, H_kv, Dh]
        pool.values[layer].index_copy_(0, layout.write_slots, v[0].transpose(0, 1))
        keys = _gather(pool.keys[layer], layout.key_slots)  # [B, H_kv, S_max, Dh]
        values = _gather(pool.values[layer], layout.key_slots)  # [B, H_kv, S_max, Dh]
        queries = _gather(q[0].transpose(0, 1), layout.query_index)  # [B, H, T_max, Dh]
        out = attend(queries, keys, values, layout.mask)  # [B, H, T_max, Dh]
        return out.transpose(1, 2)[layout.query_valid].transpose(0, 1)[None]  # [1, H, N, Dh], rows in order

    def finish(self, num_tokens: int) -> None:
        """Nothing to advance: the caller commits each row's table."""


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [R, H, Dh], index [B, S] -> [B, H, S, Dh] (index_select: no parallel region for small copies)."""
    batch, span = index.shape
    return rows.index_select(0, index.reshape(-1)).view(batch, span, *rows.shape[1:]).transpose(1, 2)
