"""Grammar masks along a draft: pure math, no model or grammar-engine imports.

Constrained decoding masks the target's logits before the sampling warps: a token the grammar forbids gets
``-inf``, so greedy takes the argmax over the allowed tokens and sampling draws from the target's distribution
renormalised over them. Speculation stays lossless when every verified position is masked exactly as plain
constrained decoding would mask it there: row ``j`` of the verify input (0 = the pending token, ``i + 1`` = draft
node ``i``) gets the mask of the grammar state after the committed tokens and the draft path down to ``j``. A draft
token the grammar forbids then has target probability 0 and is rejected by the ordinary rules (greedy: it is never
the argmax; sampling: it is accepted with probability ``p / q = 0``); the rows below it are never reached. The
drafts themselves stay as drafted (cutting a chain at a forbidden token would change which residual a rejected
sampled draft leaves, which is not lossless).

The grammar state is walked along the draft (``accept``) and rolled back to where it was (``rollback``): after
verification only the emitted tokens advance it, so it rolls back with the KV cache.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch


class GrammarState(Protocol):
    """A grammar matcher over token ids (an adapter over xgrammar's ``GrammarMatcher`` in the server)."""

    def fill_mask(self, out: torch.Tensor) -> None:
        """Write the allowed next tokens into ``out`` ([bitmask_width(vocab)] int32, bit t of word t // 32)."""

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (and no change) where the grammar forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    def terminated(self) -> bool:
        """The grammar has accepted its stop token: nothing may follow."""


def bitmask_width(vocab: int) -> int:
    return (vocab + 31) // 32


def full_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, bitmask_width(vocab)] int32 with every token allowed."""
    return torch.full((rows, bitmask_width(vocab)), -1, dtype=torch.int32)


_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]: the bits of each byte value


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [R, W] int32 -> allowed [R, vocab] bool (bit t of word t // 32 is token t), by bytes through a
    256-entry table (one gather instead of 32 shifts of every word)."""
    words = bitmask.contiguous()
    little = words.new_tensor([1]).view(torch.uint8)[0] == 1  # a word's low byte comes first in memory
    raw = words.view(torch.uint8).view(words.shape[0], -1, 4)  # [R, W, 4]
    in_order = raw if little else raw.flip(-1)
    return _BYTE_BITS[in_order.long()].flatten(1)[:, :vocab]  # [R, W * 32] -> [R, vocab]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> a copy with the forbidden tokens at -inf (bitmask [R, W] over the grammar's vocabulary;
    logits columns past it, padding rows of the embedding, are forbidden too)."""
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(bitmask, min(vocab, bitmask.shape[-1] * 32))  # [R, <= V]
    if allowed.shape[-1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]), value=False)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def draft_masks(state: GrammarState, draft_ids: Sequence[int], parents: Sequence[int] | None, vocab: int
                ) -> torch.Tensor:
    """The grammar's masks at every row of a verify input [pending, nodes...]: [n + 1, W] int32.

    ``parents`` None: a chain (node i's parent is node i - 1). Row 0 is the mask after the committed tokens, row
    ``i + 1`` the mask after the path to node ``i``. A row below a forbidden draft token (or after the grammar
    ended) can never be reached by verification; it allows everything, so its warps stay well defined. The state
    is back where it started on return."""
    n = len(draft_ids)
    parents = list(range(-1, n - 1)) if parents is None else [int(p) for p in parents]
    masks = full_bitmask(n + 1, vocab)
    state.fill_mask(masks[0])
    path: list[int] = []  # nodes the state has accepted, root first
    reachable = [True] * (n + 1)  # per row: every token on its path is allowed
    for node in range(n):
        parent = parents[node]
        if not reachable[parent + 1]:
            reachable[node + 1] = False
            continue
        ancestors = _path_to(parents, parent)
        common = _common_prefix(path, ancestors)
        state.rollback(len(path) - common)
        path = path[:common]
        for step in ancestors[common:]:  # re-walk to the parent (a sibling branch was walked before)
            state.accept(int(draft_ids[step]))  # allowed: the parent's row is reachable
            path.append(step)
        if state.terminated() or not state.accept(int(draft_ids[node])):
            reachable[node + 1] = False
            continue
        path.append(node)
        if not state.terminated():
            state.fill_mask(masks[node + 1])
    state.rollback(len(path))
    return masks


def _path_to(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's child down to ``node`` (empty for the root, -1)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    while length < min(len(a), len(b)) and a[length] == b[length]:
        length += 1
    return length


def decided_rows(draft_ids: Sequence[int], parents: Sequence[int] | None, emitted: Sequence[int]) -> list[int]:
    """The verify-input rows the emitted tokens were decided at: emitted[j] at the row of the j-th accepted node's
    parent path (a chain: row j). Verification follows the first child whose token is the emitted one (greedy and
    sampling alike), so the accepted path is recovered from the emitted tokens."""
    if parents is None:
        return list(range(len(emitted)))
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(int(parent), []).append(node)
    rows, position = [], -1  # position: the node whose children the next token chooses among (-1: the root)
    for token in emitted:
        rows.append(position + 1)
        position = next((c for c in children.get(position, []) if int(draft_ids[c]) == token), None)
        if position is None:
            break
    return rows
