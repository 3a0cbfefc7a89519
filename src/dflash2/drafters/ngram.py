"""Prompt lookup (n-gram) drafting: copy what followed the latest n-gram's earlier occurrence in the sequence."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import numpy as np
import torch

from dflash2.drafters.base import Draft, Drafter, ExtendsAhead
from dflash2.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from dflash2.drafters.spec import DraftOptions, DraftTarget


def find_ngram_continuation(
    sequence: list[int], num_tokens: int, min_n: int = 1, max_n: int = 4, stop_ids: Collection[int] = ()
) -> list[int]:
    """Tokens that followed an earlier occurrence of the sequence's last n tokens.

    The longest n in [min_n, max_n] with a match wins; among occurrences of that n-gram the earliest wins.
    The continuation stops after a stop id (nothing past an EOS is proposed).
    """
    candidates = find_ngram_candidates(sequence, num_tokens, 1, min_n, max_n, stop_ids)
    return candidates[0] if candidates else []


def find_ngram_candidates(
    sequence: list[int],
    num_tokens: int,
    max_candidates: int,
    min_n: int = 1,
    max_n: int = 4,
    stop_ids: Collection[int] = (),
) -> list[list[int]]:
    """Up to ``max_candidates`` distinct continuations: longer n-gram matches first, earlier occurrences first."""
    tokens = np.asarray(sequence, dtype=np.int64)
    length = len(tokens)
    found: list[list[int]] = []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n], suffix excluded
        for hit in np.flatnonzero((windows == suffix).all(axis=1)):
            start = int(hit) + n
            continuation = _cut_after_stop(tokens[start : start + num_tokens].tolist(), stop_ids)
            if continuation and continuation not in found:
                found.append(continuation)
                if len(found) == max_candidates:
                    return found
    return found


def merge_into_tree(candidates: list[list[int]]) -> tuple[list[int], list[int]]:
    """Merge token paths into a trie: (node tokens, parent of each node, -1 = child of the root)."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for path in candidates:
        parent = -1
        for token in path:
            node = children.get((parent, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                children[(parent, token)] = node
            parent = node
    return tokens, parents


def _cut_after_stop(tokens: list[int], stop_ids: Collection[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


class NgramDrafter(ExtendsAhead, Drafter):
    """Deterministic drafter (q_draft is one-hot): lossless at any temperature through the exact one-hot rule.

    With ``num_candidates > 1`` several continuations (from different earlier occurrences) are merged into a
    tree and verified together in one target pass with tree attention.
    """

    name = "ngram"

    def __init__(
        self,
        num_draft_tokens: int = 8,
        min_n: int = 1,
        max_n: int = 4,
        stop_ids: Collection[int] = (),
        num_candidates: int = 1,
    ) -> None:
        super().__init__(num_draft_tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        self.min_n, self.max_n = min_n, max_n
        self.stop_ids = frozenset(stop_ids)
        self.num_candidates = num_candidates

    @property
    def max_draft_tokens(self) -> int:
        """KV slots one verification may need: every node of the tree."""
        return self.num_draft_tokens * self.num_candidates

    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        candidates = find_ngram_candidates(
            sequence, num_draft_tokens, self.num_candidates, self.min_n, self.max_n, self.stop_ids
        )
        if self.num_candidates == 1 or len(candidates) <= 1:
            chain = candidates[0] if candidates else []
            return Draft(tokens=torch.tensor(chain, dtype=torch.int64), q_draft=None)
        tokens, parents = merge_into_tree(candidates)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.int64), q_draft=None, parents=parents)


def build_ngram_drafter(target: DraftTarget, options: DraftOptions) -> NgramDrafter:
    """``ngram[:kxW]``: prompt lookup stopping at the target's EOS ids; W continuations merged into a tree."""
    return NgramDrafter(options.num_draft_tokens, stop_ids=target.tokenizer.eos_token_ids,
                        num_candidates=options.spec.width)
