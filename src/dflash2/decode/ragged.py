"""One target forward over a ragged batch: rows of different lengths (a prompt, a pending token plus k drafts or
a tree of drafts, a lone pending token) over a paged KV cache.

The decoder's own forward runs over the N real tokens flattened (no padding in projections and feed-forward);
only attention pads, to ``[B, T_max]`` queries over ``[B, S_max]`` gathered keys, with a mask that gives each
query its own row's cached slots and the row's new tokens up to itself (a chain) or its ancestors (a tree).

Padding makes attention's transient memory (the gathered keys / values and queries, the mask, the output) grow
with ``B x T_max x S_max``: one long prompt chunk next to fifteen one-token rows would pad all sixteen to the
chunk. So rows are split into attention groups (rows of similar length together) whose padded workspace stays
within a budget (``workspace_bytes``; a row that alone exceeds it gets a group of its own). The attention kernel
is row invariant, so the grouping changes no bit of any row's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2.kv.paged import BlockTable, PagedKVPool
from dflash2.models.attention import SlidingWindow, attend
from dflash2.models.decoder import Transformer
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask

DEFAULT_WORKSPACE_BYTES = 64 * 2**20  # padded attention workspace per layer and group (BatchConfig overrides)


@dataclass
class RaggedRow:
    table: BlockTable  # the row's KV blocks; its new tokens are written at [table.length, table.length + T)
    tokens: list[int]  # [T] new input ids (T >= 1)
    all_logits: bool  # True: logits of every new token (verification); False: of the last one only (prefill)
    parents: list[int] | None = None  # a tree over tokens[1:] (tokens[0] is the pending token); None = a chain


@dataclass(frozen=True)
class WorkspaceCost:
    """Bytes of attention's padded transient tensors per unit of padding, from the model's shapes."""

    per_key_slot: int  # gathered keys and values: 2 x H_kv x Dh x element size, per [B, S_max] cell
    per_query: int  # gathered queries + the fp32 output and its selected copy, per [B, T_max] cell
    per_mask_cell: int = 1  # the bool mask, per [B, T_max, S_max] cell

    @staticmethod
    def of(model: Transformer) -> WorkspaceCost:
        c = model.config
        element = torch.empty((), dtype=model.dtype).element_size()
        return WorkspaceCost(per_key_slot=2 * c.num_kv_heads * c.head_dim * element,
                             per_query=c.num_heads * c.head_dim * (element + 8))

    def bytes(self, batch: int, queries: int, keys: int) -> int:
        return batch * (keys * self.per_key_slot + queries * self.per_query + queries * keys * self.per_mask_cell)


@dataclass
class AttentionGroup:
    """Rows attended together: their queries padded to ``[B_g, T_g]``, their visible slots to ``[B_g, S_g]``."""

    flat_index: torch.Tensor  # [n_g] int64, flat indices of the group's real queries (row by row)
    query_index: torch.Tensor  # [B_g, T_g] int64, flat index of row r's i-th new token (padding: 0)
    query_valid: torch.Tensor  # [B_g, T_g] bool
    key_slots: torch.Tensor  # [B_g, S_g] int64, pool slots of row r's visible keys (padding: 0)
    mask: torch.Tensor  # [B_g, 1, T_g, S_g] bool, True = may attend
    workspace_bytes: int  # the padded transient bytes of one layer's attention over this group
    key_positions: torch.Tensor  # [B_g, S_g] int64, the position of each visible key (padding: 0)


@dataclass
class RaggedLayout:
    """Index tensors of one ragged forward, built once and shared by every layer."""

    input_ids: torch.Tensor  # [N] int64, the rows' new tokens concatenated
    positions: torch.Tensor  # [N] int64
    write_slots: torch.Tensor  # [N] int64, the pool slot each new token's keys/values go to
    groups: list[AttentionGroup]
    logit_index: torch.Tensor  # [M] int64, flat indices whose logits are returned
    logit_rows: list[tuple[int, int]]  # per row: [start, end) of its logits in the [M] result

    @property
    def workspace_bytes(self) -> int:
        """The largest group's padded workspace: attention's transient peak per layer."""
        return max(group.workspace_bytes for group in self.groups)


def group_rows(rows: list[RaggedRow], cost: WorkspaceCost, budget: int) -> list[list[int]]:
    """Row indices in attention groups: rows ordered by (new tokens, visible slots), cut greedily where a group's
    padded workspace would pass ``budget`` (a row alone above it is a group of its own)."""
    order = sorted(range(len(rows)), key=lambda r: (len(rows[r].tokens), rows[r].table.length + len(rows[r].tokens)))
    groups: list[list[int]] = []
    queries = keys = 0
    for r in order:
        n = len(rows[r].tokens)
        span = rows[r].table.length + n
        grown = (max(queries, n), max(keys, span))
        if groups and cost.bytes(len(groups[-1]) + 1, *grown) <= budget:
            groups[-1].append(r)
            queries, keys = grown
        else:
            groups.append([r])
            queries, keys = n, span
    return [sorted(group) for group in groups]  # rows in input order within a group: one group needs no scatter


def build_layout(rows: list[RaggedRow], device: torch.device, cost: WorkspaceCost | None = None,
                 workspace_bytes: int | None = None) -> RaggedLayout:
    """The layout of one forward; without ``cost`` every row is in one attention group."""
    ids, positions, writes, logit_index, logit_rows, starts = [], [], [], [], [], []
    flat = 0
    for row in rows:
        n, start = len(row.tokens), row.table.length
        ids.extend(row.tokens)
        writes.append(row.table.slots(start, start + n))
        positions.extend(range(start, start + n) if row.parents is None
                         else target_positions(compile_tree(row.parents), start).tolist())  # start + depth
        first = flat if row.all_logits else flat + n - 1
        logit_rows.append((len(logit_index), len(logit_index) + flat + n - first))
        logit_index.extend(range(first, flat + n))
        starts.append(flat)
        flat += n
    members = ([list(range(len(rows)))] if cost is None
               else group_rows(rows, cost, DEFAULT_WORKSPACE_BYTES if workspace_bytes is None else workspace_bytes))
    return RaggedLayout(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        write_slots=torch.cat(writes).to(device),
        groups=[_group([rows[r] for r in member], [starts[r] for r in member], cost, device) for member in members],
        logit_index=torch.tensor(logit_index, device=device),
        logit_rows=logit_rows,
    )


def _group(rows: list[RaggedRow], starts: list[int], cost: WorkspaceCost | None,
           device: torch.device) -> AttentionGroup:
    lengths = [len(row.tokens) for row in rows]
    spans = [row.table.length + n for row, n in zip(rows, lengths)]  # visible slots per row
    t_max, s_max = max(lengths), max(spans)
    batch = len(rows)
    query_index = torch.zeros(batch, t_max, dtype=torch.int64)
    key_slots = torch.zeros(batch, s_max, dtype=torch.int64)
    key_positions = torch.zeros(batch, s_max, dtype=torch.int64)
    mask = torch.zeros(batch, 1, t_max, s_max, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # padded queries see one slot (their output is dropped) so softmax stays finite
    for r, (row, n, span, flat) in enumerate(zip(rows, lengths, spans, starts)):
        start = row.table.length
        key_slots[r, :span] = row.table.slots(0, span)
        query_index[r, :n] = torch.arange(flat, flat + n)
        if row.parents is None:
            mask[r, 0, :n, :span] = torch.arange(span)[None, :] <= torch.arange(start, span)[:, None]  # causal
            key_positions[r, :span] = torch.arange(span)
        else:  # each node sees the cached slots, the pending token and its ancestors
            tree = compile_tree(row.parents)
            mask[r, 0, :n, :span] = tree_attention_mask(tree, start)
            key_positions[r, :start] = torch.arange(start)
            key_positions[r, start:span] = target_positions(tree, start)  # start + depth
    valid = torch.arange(t_max)[None, :] < torch.tensor(lengths)[:, None]  # [B_g, T_max]
    return AttentionGroup(
        flat_index=query_index[valid].to(device),
        query_index=query_index.to(device),
        query_valid=valid.to(device),
        key_slots=key_slots.to(device),
        mask=mask.to(device),
        workspace_bytes=cost.bytes(batch, t_max, s_max) if cost is not None else 0,
        key_positions=key_positions.to(device),
    )


@dataclass
class RaggedOutput:
    logits: list[torch.Tensor]  # per row float32 [T or 1, V]
    hidden: list[dict[int, torch.Tensor]]  # per row: tapped layer -> [1, T, D] hidden states of its new tokens
    workspace_bytes: int = 0  # attention's padded transient peak per layer (see RaggedLayout.workspace_bytes)


@torch.inference_mode()
def ragged_forward(model: Transformer, pool: PagedKVPool, rows: list[RaggedRow],
                   hidden_layers: tuple[int, ...] = (), workspace_bytes: int | None = None) -> RaggedOutput:
    """Write every row's new tokens into the pool; return per row its logits and the hidden states (outputs of
    the decoder layers ``hidden_layers``) of its new tokens. The decoder's own forward runs over the N real
    tokens as one sequence; only its attention is ragged (:class:`RaggedAttention`), in groups whose padded
    workspace stays within ``workspace_bytes`` (default :data:`DEFAULT_WORKSPACE_BYTES`).

    The rows' ``table.length`` is not moved: the caller commits (rolls back to) the slots it keeps.
    """
    layout = build_layout(rows, model.device, WorkspaceCost.of(model), workspace_bytes)
    out = model(layout.input_ids[None], positions=layout.positions[None], hidden_layers=hidden_layers,
                logits=layout.logit_index, context=RaggedAttention(pool, layout))
    logits = out.logits[0]  # [M, V]
    taps = dict(zip(hidden_layers, out.hidden_states))  # layer -> [1, N, D]
    bounds = torch.tensor([0, *(len(row.tokens) for row in rows)]).cumsum(0).tolist()
    hidden = [{layer: t[:, bounds[r] : bounds[r + 1]] for layer, t in taps.items()} for r in range(len(rows))]
    return RaggedOutput([logits[start:end] for start, end in layout.logit_rows], hidden, layout.workspace_bytes)


class RaggedAttention:
    """The decoder's attention over a ragged batch: new keys/values go to the rows' pool slots; each attention
    group's queries attend, padded to ``[B_g, T_g]``, to their rows' visible slots gathered from the pool
    (``[B_g, S_g]``)."""

    def __init__(self, pool: PagedKVPool, layout: RaggedLayout) -> None:
        self.pool, self.layout = pool, layout
        self._windowed: dict[tuple[int, int], torch.Tensor] = {}  # (group, window) -> mask: once per forward

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: SlidingWindow | None = None) -> torch.Tensor:
        """q [1, H, N, Dh], k / v [1, H_kv, N, Dh] over the N real tokens -> [1, H, N, Dh]; ``window``: a
        sliding-window layer's limit on top of each row's mask (by the rows' positions)."""
        layout, pool = self.layout, self.pool
        pool.keys[layer].index_copy_(0, layout.write_slots, k[0].transpose(0, 1))  # [N, H_kv, Dh]
        pool.values[layer].index_copy_(0, layout.write_slots, v[0].transpose(0, 1))
        flat_q = q[0].transpose(0, 1)  # [N, H, Dh]
        out: torch.Tensor | None = None
        for index, group in enumerate(layout.groups):
            keys = _gather(pool.keys[layer], group.key_slots)  # [B_g, H_kv, S_g, Dh]
            values = _gather(pool.values[layer], group.key_slots)  # [B_g, H_kv, S_g, Dh]
            queries = _gather(flat_q, group.query_index)  # [B_g, H, T_g, Dh]
            mask = group.mask if window is None else self._window_mask(index, group, window)
            attended = attend(queries, keys, values, mask)  # [B_g, H, T_g, Dh]
            real = attended.transpose(1, 2)[group.query_valid]  # [n_g, H, Dh], rows in order
            if len(layout.groups) == 1:
                return real.transpose(0, 1)[None]
            if out is None:
                out = real.new_empty(flat_q.shape)
            out.index_copy_(0, group.flat_index, real)
        return out.transpose(0, 1)[None]  # [1, H, N, Dh]

    def finish(self, num_tokens: int) -> None:
        """Nothing to advance: the caller commits each row's table."""

    def _window_mask(self, index: int, group: AttentionGroup, window: SlidingWindow) -> torch.Tensor:
        """[B_g, 1, T_g, S_g]: the group's mask within the window (a row's cached slot i holds position i)."""
        key = (index, window.size)
        if key not in self._windowed:
            queries = self.layout.positions[group.query_index]  # [B_g, T_g]
            mask = window.restrict(group.mask, group.key_positions, queries)
            mask[:, 0, :, 0] |= ~group.query_valid  # padded queries keep their one slot (softmax stays finite)
            self._windowed[key] = mask
        return self._windowed[key]


def _gather(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [R, H, Dh], index [B, S] -> [B, H, S, Dh] (index_select: no parallel region for small copies)."""
    batch, span = index.shape
    return rows.index_select(0, index.reshape(-1)).view(batch, span, *rows.shape[1:]).transpose(1, 2)
