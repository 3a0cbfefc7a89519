"""A long prompt-lookup match when there is one, a DFlash block otherwise.

Prompt lookup is nearly free and, when the text repeats (code edits, quoting the question, summaries), its
long matches are accepted in full; the block drafter covers everything else. The block drafter observes every
step (its context cache must follow the sequence) even when the n-gram draft is the one verified.
"""

from __future__ import annotations

import torch

from dflash2.drafters.base import Draft, Drafter, ExtendsAhead, shared_pass, unread
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.ngram import find_ngram_continuation
from dflash2.verify.sampling import SamplingParams


class HybridDrafter(ExtendsAhead, Drafter):
    """Chooses per step: the n-gram continuation when its match is at least ``min_match`` tokens long and it
    proposes at least ``min_tokens`` tokens, else the block drafter's draft.

    Capabilities (drafters/base.py): ``KeepsState``, ``CatchesUp`` and ``SharesPasses`` through its block drafter,
    ``MayLookUp`` (a lookup step runs no pass), ``DraftsAhead`` when the block drafter reads ids only (pard)."""

    name = "dflash+ngram"

    def __init__(self, block: DFlashDrafter, num_draft_tokens: int | None = None, *, min_match: int = 3,
                 max_match: int = 8, min_tokens: int = 4, stop_ids=()) -> None:
        super().__init__(num_draft_tokens or block.num_draft_tokens)
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.block = block
        self.name = f"{block.name}+ngram"
        self.hidden_layers = block.hidden_layers
        self.cost_per_pass = block.cost_per_pass  # the lookup is nearly free; the block drafter is what costs
        self.min_match, self.max_match, self.min_tokens = min_match, max_match, min_tokens
        self.stop_ids = frozenset(stop_ids)
        self.ngram_steps = 0  # steps drafted by prompt lookup (the rest came from the block drafter)
        self._last_lookup: tuple[tuple[tuple[int, ...], int], list[int]] | None = None  # ((sequence, k), draft)
        self.block_steps = 0

    @property
    def max_draft_tokens(self) -> int:
        return max(self.num_draft_tokens, self.block.max_draft_tokens)  # the block drafter may draft a tree

    def for_request(self) -> HybridDrafter:
        """The same settings over a copy of the block drafter for the new request (its own context cache)."""
        return HybridDrafter(self.block.for_request(), self.num_draft_tokens, min_match=self.min_match,
                             max_match=self.max_match, min_tokens=self.min_tokens, stop_ids=self.stop_ids)

    def reset(self, capacity: int) -> None:
        self.block.reset(capacity)
        self._last_lookup = None

    def unread(self, sequence: list[int]) -> int:
        return unread(self.block, sequence)

    def runs_a_pass(self, sequence: list[int], num_draft_tokens: int) -> bool:
        return not self._lookup(sequence, num_draft_tokens)

    def shared_pass(self, sequence: list[int], num_draft_tokens: int) -> tuple[Drafter, int] | None:
        if self._lookup(sequence, num_draft_tokens):
            return None
        return shared_pass(self.block, sequence, self._block_k(num_draft_tokens))

    def drafted_by_shared_pass(self) -> None:
        self.block_steps += 1

    def _block_k(self, num_draft_tokens: int) -> int:
        return min(num_draft_tokens, self.num_draft_tokens, self.block.num_draft_tokens)

    def _lookup(self, sequence: list[int], num_draft_tokens: int) -> list[int]:
        """The prompt-lookup draft when its match is long enough (empty: the block drafter drafts); the last answer
        is kept, since a step asks for it more than once."""
        k = min(num_draft_tokens, self.num_draft_tokens)
        key = (tuple(sequence), k)
        if self._last_lookup is None or self._last_lookup[0] != key:
            lookup = find_ngram_continuation(sequence, k, self.min_match, self.max_match, self.stop_ids)
            self._last_lookup = (key, lookup if lookup and len(lookup) >= min(self.min_tokens, k) else [])
        return self._last_lookup[1]

    def state_bytes(self, capacity: int) -> int:
        return self.block.state_bytes(capacity)

    def held_bytes(self) -> int:
        return self.block.held_bytes()

    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        self.block.prefill(prompt_ids, prompt_length)

    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        self.block.observe(sequence, num_accepted, target_hidden)

    def propose(
        self, sequence: list[int], num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        lookup = self._lookup(sequence, num_draft_tokens)
        if lookup:
            self.ngram_steps += 1
            return Draft(tokens=torch.tensor(lookup, dtype=torch.int64), q_draft=None)  # deterministic: exact rule
        self.block_steps += 1
        return self.block.propose(sequence, self._block_k(num_draft_tokens), params, generator)
