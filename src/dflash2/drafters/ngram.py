"""Prompt lookup (n-gram) drafting: copy what followed the latest n-gram's earlier occurrence in the sequence."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from dflash2.drafters.base import Draft, Drafter
from dflash2.verify.sampling import SamplingParams


def find_ngram_continuation(
    sequence: list[int], num_tokens: int, min_n: int = 1, max_n: int = 4, stop_ids: Collection[int] = ()
) -> list[int]:
    """Tokens that followed an earlier occurrence of the sequence's last n tokens.

    The longest n in [min_n, max_n] with a match wins; among occurrences of that n-gram the earliest wins.
    The continuation stops after a stop id (nothing past an EOS is proposed) and never overlaps the suffix itself.
    """
    tokens = np.asarray(sequence, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n], excludes the suffix itself
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size == 0:
            continue
        start = int(hits[0]) + n
        continuation = tokens[start : start + num_tokens].tolist()
        return _cut_after_stop(continuation, stop_ids)
    return []


def _cut_after_stop(tokens: list[int], stop_ids: Collection[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


class NgramDrafter(Drafter):
    """Deterministic drafter (q_draft is one-hot): lossless at any temperature through the exact one-hot rule."""

    name = "ngram"

    def __init__(self, num_draft_tokens: int = 8, min_n: int = 1, max_n: int = 4, stop_ids: Collection[int] = ()) -> None:
        super().__init__(num_draft_tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.stop_ids = frozenset(stop_ids)

    def propose(self, sequence, num_draft_tokens, params: SamplingParams, generator) -> Draft:
        tokens = find_ngram_continuation(sequence, num_draft_tokens, self.min_n, self.max_n, self.stop_ids)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.int64), q_draft=None)
