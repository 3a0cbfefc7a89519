"""Drafts shaped by a request's grammar: a wrapper around any chain drafter for constrained decoding.

Under a JSON schema much of a reply is decided by the grammar (keys, their quotes), and a drafter that never saw
the schema proposes tokens the grammar forbids, which verification rejects for certain. The wrapper walks the
request's grammar state along the draft position by position:

- where the grammar forces a continuation (``forced_tokens``: xgrammar's jump-forward tokens, the longest
  vocabulary tokens covering the forced text, the last one left out when a longer token could extend it), the
  first forced token is the draft there, and the draft may run past the drafter's length while tokens are forced;
- else the drafter's token at that position, while the draft so far equals the drafter's own (after a forced token
  that differs from the drafter's, its later tokens were drafted for another prefix and are dropped);
- a sampled drafter token the grammar forbids is replaced by the likeliest allowed token of that position's
  distribution, which becomes ``q`` restricted to the allowed tokens with the forbidden mass moved onto the
  replacement: the token is drawn from exactly that distribution, so rejection sampling against it stays exact;
- where the drafter has nothing for the prefix (its draft is used up, follows another prefix, or its deterministic
  token is forbidden: verification would reject it for certain), a grammar-checked lookup: the token that followed
  an earlier occurrence of the last tokens (prompt lookup, longest match first), the first such the grammar allows,
  up to the drafter's length. JSON repeats itself (the punctuation and indentation between fields; values copied
  from the prompt): replaying two of the default target's greedy extraction replies, forced plus looked-up tokens
  alone reached tau 2.0 (forced alone 1.1; the first lookup candidate only, cut where forbidden, 1.8).

Only proposals change: verification masks the target's logits exactly as before (``verify/grammar.py``), so greedy
output equals constrained plain decoding and sampled output keeps the constrained target's distribution. Forced
tokens are deterministic drafts (a one-hot ``q`` row in a sampled chain, which the chain rule treats as the
deterministic rule). Whether a position is drafted depends only on the tokens before it (a stopping time), and a
forbidden sampled token is replaced rather than cut (cutting at it would change the residual a rejection leaves).

The grammar state is the request's own (the one verification masks with), shared by reference: ``propose`` walks it
and rolls it back to where it was, so it always sits after the committed tokens. Tree drafts pass through
unchanged (verification masks every node's path, as before).
"""

from __future__ import annotations

from typing import Protocol

import torch

from dflash2.drafters.base import Draft, Drafter, KeepsState, runs_a_pass, state_bytes, unread
from dflash2.drafters.ngram import find_ngram_candidates
from dflash2.verify.grammar import GrammarState, full_bitmask, unpack_bitmask
from dflash2.verify.sampling import SamplingParams

MAX_FORCED_EXTRA = 8  # forced tokens a draft may hold past the drafter's length (a long key is ~2-4 tokens)
LOOKUP_CANDIDATES = 4  # continuations of the context's suffix tried against the grammar, longest match first
LOOKUP_MAX_MATCH = 4  # suffix tokens matched at most


class DraftGrammar(GrammarState, Protocol):
    """A grammar state that can also say which tokens it forces next (optional: a state without
    ``forced_tokens`` forces nothing, and only the forbidden drafts go)."""

    def forced_tokens(self) -> list[int]:
        """Tokens certain to follow under the grammar from its state, without changing it (empty: a choice)."""


class GrammarDrafter(Drafter):
    """``inner``'s chain drafts fitted to ``grammar`` (see the module doc); every other verb goes to ``inner``.

    Capabilities: ``KeepsState`` and ``CatchesUp`` through ``inner``, ``MayLookUp`` (``inner``'s answer),
    ``DraftsForFree`` (forced and looked-up tokens, where the batch planner grants no drafts). Not
    ``SharesPasses``: a shared pass's draft would skip the grammar, so a constrained request drafts alone."""

    def __init__(self, inner: Drafter, grammar: DraftGrammar | GrammarState, max_forced_extra: int = MAX_FORCED_EXTRA) -> None:
        super().__init__(inner.num_draft_tokens)
        self.inner, self.grammar, self.max_forced_extra = inner, grammar, max_forced_extra
        self._forced = getattr(grammar, "forced_tokens", list)
        self.name = inner.name
        self.hidden_layers = inner.hidden_layers
        self.cost_per_pass = inner.cost_per_pass
        self.forced_drafts = 0  # forced draft tokens the drafter did not propose there (counters for benchmarks)
        self.cut_drafts = 0  # drafter tokens dropped or replaced because the grammar forbids them
        self.looked_up_drafts = 0  # draft tokens from the grammar-checked lookup

    @property
    def max_draft_tokens(self) -> int:
        return self.inner.max_draft_tokens + self.max_forced_extra

    def for_request(self) -> GrammarDrafter:
        raise TypeError("a grammar drafter belongs to one request's grammar state; wrap the request's own drafter")

    def state_bytes(self, capacity: int) -> int:
        return state_bytes(self.inner, capacity)

    def held_bytes(self) -> int:
        return self.inner.held_bytes() if isinstance(self.inner, KeepsState) else 0

    def unread(self, sequence: list[int]) -> int:
        return unread(self.inner, sequence)

    def runs_a_pass(self, sequence: list[int], num_draft_tokens: int) -> bool:
        return runs_a_pass(self.inner, sequence, num_draft_tokens)

    def reset(self, capacity: int) -> None:
        self.inner.reset(capacity)

    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        self.inner.prefill(prompt_ids, prompt_length)

    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        self.inner.observe(sequence, num_accepted, target_hidden)

    def propose(self, sequence: list[int], num_draft_tokens: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        if self.grammar.terminated():
            return Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)
        draft = self.inner.propose(sequence, num_draft_tokens, params, generator)
        if draft.parents is not None:
            return draft
        return self.shape(draft, sequence, num_draft_tokens, num_draft_tokens + self.max_forced_extra)

    def free_draft(self, sequence: list[int]) -> Draft | None:
        """Forced and looked-up tokens from here, without the drafter (where the planner grants no drafts)."""
        if self.grammar.terminated():
            return None
        empty = Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)
        draft = self.shape(empty, sequence, self.num_draft_tokens, self.num_draft_tokens + self.max_forced_extra)
        return draft if len(draft.tokens) else None

    def shape(self, draft: Draft, sequence: list[int], lookup_limit: int, limit: int) -> Draft:
        """The chain ``draft`` (following ``sequence``) fitted to the grammar from its current state (left there on
        return): at most ``limit`` tokens, looked-up ones only before ``lookup_limit``, forced ones up to ``limit``."""
        drafted = draft.tokens.tolist()
        tokens: list[int] = []
        rows: list[torch.Tensor | None] = []  # per token its q row; None: deterministic (forced)
        aligned = True  # tokens == drafted[: len(tokens)]: the drafter's next token follows this prefix
        try:
            while len(tokens) < limit and not self.grammar.terminated():
                position = len(tokens)
                forced = self._forced()
                ours = drafted[position] if aligned and position < len(drafted) else None
                if forced:  # deterministic whatever the drafter sampled: a one-hot row, never the drafter's q
                    token, row = forced[0], None
                    if not self.grammar.accept(token):
                        break
                    self.forced_drafts += token != ours
                elif ours is not None and self.grammar.accept(ours):
                    token, row = ours, None if draft.q_draft is None else draft.q_draft[position]
                elif ours is not None and draft.q_draft is not None:
                    self.cut_drafts += 1
                    token, row = self._replace(draft.q_draft[position])
                    if not self.grammar.accept(token):
                        break
                else:  # the drafter has nothing (more) for this prefix, or a deterministic token the grammar forbids
                    self.cut_drafts += ours is not None
                    token = self._look_up(sequence + tokens) if position < lookup_limit else None
                    if token is None:
                        break
                    row = None
                    self.looked_up_drafts += 1
                aligned = aligned and token == ours
                tokens.append(token)
                rows.append(row)
        finally:
            self.grammar.rollback(len(tokens))
        return Draft(tokens=torch.tensor(tokens, dtype=torch.int64), q_draft=_q_rows(draft.q_draft, tokens, rows))

    def _look_up(self, context: list[int]) -> int | None:
        """The next token where the context's last tokens occurred before (longest match first), among those the
        grammar allows; accepted into the grammar state. JSON repeats itself: the punctuation and indentation
        between fields, the values copied from the prompt."""
        for (token,) in find_ngram_candidates(context, 1, LOOKUP_CANDIDATES, 1, LOOKUP_MAX_MATCH):
            if self.grammar.accept(token):
                return token
        return None

    def _replace(self, q: torch.Tensor) -> tuple[int, torch.Tensor]:
        """A sampled draft the grammar forbids -> the likeliest allowed token of ``q`` [V] and the distribution
        that token was drawn from: q on the allowed tokens, the forbidden mass on the replacement."""
        vocab = q.shape[-1]
        mask = full_bitmask(1, vocab)
        self.grammar.fill_mask(mask[0])
        allowed = unpack_bitmask(mask, vocab)[0].to(q.device)  # [V]
        token = int(torch.where(allowed, q, torch.full_like(q, -1.0)).argmax())
        replaced = torch.where(allowed, q, torch.zeros_like(q))
        replaced[token] += 1.0 - replaced.sum()
        return token, replaced


def _q_rows(q_draft: torch.Tensor | None, tokens: list[int], rows: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The shaped chain's q_draft: None for deterministic drafts, else the kept rows with a one-hot row for each
    forced token (the chain rule's deterministic case)."""
    if q_draft is None or not tokens:
        return None
    out = torch.zeros(len(tokens), q_draft.shape[-1], dtype=q_draft.dtype, device=q_draft.device)
    for position, (token, row) in enumerate(zip(tokens, rows)):
        if row is None:
            out[position, token] = 1.0
        else:
            out[position] = row
    return out
