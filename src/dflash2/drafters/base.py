"""The drafter contract: a core of four verbs that every loop calls, and optional capabilities that only the
callers that use them ask for.

The core (:class:`Drafter`): ``reset`` (begin a sequence) and ``prefill`` (read the prompt while the target
prefills), ``propose`` (a :class:`Draft`: what verification needs, the tokens, their distributions and a tree's
parents), ``observe`` (what the target committed, with the hidden states of the layers the drafter declares).

Capabilities are runtime-checkable protocols; a caller checks ``isinstance`` and otherwise takes the plain meaning:

- :class:`KeepsState` (batch engine): a copy per request, and the memory its caches take. Without: one object
  shared by every request, no memory.
- :class:`CatchesUp` / :class:`MayLookUp` (batch draft planner): ids to read before the next draft; whether a
  draft runs the network at all. Without: nothing to read, every draft a pass.
- :class:`SharesPasses` / :class:`BatchesPasses` (batch engine): drafts that are passes of one network shared by
  several requests, run as one forward. Without: each request drafts alone.
- :class:`DraftsForFree` (batch engine): tokens known without a pass, proposed where the planner grants no drafts.
  Without: no drafts there.
- :class:`DraftsAhead` (overlapped pipeline): a draft of the block after the one being verified. Without: no
  drafting ahead. :class:`ExtendsAhead` gives it to a drafter that reads ids only.

A new drafter is one module with one :class:`Drafter` subclass (the core, plus the capabilities it uses) and one
line in the table of ``drafters/spec.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dflash2.verify.sampling import SamplingParams


@dataclass
class Draft:
    """A chain of k proposals, or a tree of n nodes when ``parents`` is given (several candidates at once)."""

    tokens: torch.Tensor  # [k] (chain) or [n] (tree nodes) int64 proposed ids; may be empty
    q_draft: torch.Tensor | None  # chain: [k, vocab] distributions the tokens were sampled from; None = deterministic
    parents: list[int] | None = None  # tree: parent node of each node (-1 = child of the pending token); None = chain
    # [k] / [n] float32: the drafter's probability of each node's token where its parent (or the pending token) is
    # the target's; the draft-length policy trims a draft by it (decode/draft_length.py). None: not known.
    confidence: torch.Tensor | None = None

    @property
    def depth(self) -> int:
        """Longest path of drafts: k for a chain, the tree's depth for a tree."""
        if self.parents is None:
            return len(self.tokens)
        return max(node_depths(self.parents), default=0)


def node_depths(parents: list[int]) -> list[int]:
    """Each tree node's depth (1: a child of the pending token) from its parent (-1: the pending token); parents
    precede their children."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


class Drafter(ABC):
    """Proposes tokens that the target then verifies.

    The sequence passed around is the prompt plus every committed token; its LAST token is "pending": committed
    but not yet written into the target's KV cache (it is the first input of the next verification pass).
    """

    name: str = "drafter"
    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads (empty: none)
    cost_per_pass: bool = False  # drafting k tokens costs one forward whatever k (a block drafter), not k forwards

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens <= 0:
            raise ValueError(f"num_draft_tokens must be > 0, got {num_draft_tokens}")
        self.num_draft_tokens = num_draft_tokens

    @property
    def max_draft_tokens(self) -> int:
        """Nodes of the largest draft: the KV slots one verification may need past the pending token."""
        return self.num_draft_tokens

    def reset(self, capacity: int) -> None:
        """Start a new sequence; ``capacity`` bounds its length (prompt + generated + one draft block). A drafter
        without per-sequence state has nothing to do."""

    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        """During the target's prefill: committed prompt ids (a prefix of every later ``sequence``) that a drafter
        with its own context cache may read now, so that its first draft pass reads only the pending token and
        the prompt's cost counts as prefill (time to first token), as in every engine that runs a draft model.
        ``prompt_length``: the whole prompt's length when ``prompt_ids`` is only its first chunks (the batch
        engine's chunked prefill); None: ``prompt_ids`` is all of it.
        Optional work: ``propose`` reads whatever the drafter has not seen, so skipping it changes only timing. A
        drafter without a cache, or one fed the target's hidden states, reads nothing here."""

    @abstractmethod
    def propose(
        self, sequence: list[int], num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Draft at most ``num_draft_tokens`` tokens to follow ``sequence``."""

    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """After prefill (num_accepted = -1) or a verification: ``sequence`` is the new committed sequence.

        target_hidden: for each of ``hidden_layers``, [1, n, D] states of the n positions the target has just
        written to its cache and kept (the prompt after prefill; the pending token + accepted drafts after a step).
        A drafter that reads ids only finds all it needs in the next ``propose``'s sequence.
        """


# ---- capabilities ------------------------------------------------------------------------------------------


@runtime_checkable
class KeepsState(Protocol):
    """A drafter with per-request state (its own caches): the batch engine gives each request its own copy and
    reserves the copy's memory."""

    def for_request(self) -> Drafter:
        """A drafter like this one for another request decoded at the same time: the same weights and settings,
        its own per-sequence state."""

    def state_bytes(self, capacity: int) -> int:
        """Memory its per-request state takes after ``reset(capacity)`` (its own caches; weights are shared)."""

    def held_bytes(self) -> int:
        """Memory its per-request state holds now."""


@runtime_checkable
class CatchesUp(Protocol):
    """A drafter that reads the committed ids itself (a draft model's cache): after steps without drafts it has a
    backlog to read at its next draft, which the batch planner prices."""

    def unread(self, sequence: list[int]) -> int:
        """Ids of ``sequence`` the next ``propose`` must read before drafting (>= 1 for a draft model: the pending
        id); 0: nothing to catch up."""


@runtime_checkable
class MayLookUp(Protocol):
    """A drafter whose draft is sometimes a lookup that costs ~nothing instead of its network's pass."""

    def runs_a_pass(self, sequence: list[int], num_draft_tokens: int) -> bool:
        """Whether drafting after ``sequence`` runs the drafter's network (False: a lookup)."""


@runtime_checkable
class BatchesPasses(Protocol):
    """A network drafter whose passes for several requests can run as ONE forward."""

    @staticmethod
    def propose_batch(requests: list[tuple[Drafter, list[int], int, SamplingParams, torch.Generator | None]]
                      ) -> list[Draft]:
        """The drafts of several requests whose drafters share this network, each as its own ``propose`` would
        make it: (drafter, sequence, k, params, generator) per request."""


@runtime_checkable
class SharesPasses(Protocol):
    """A drafter whose step may be one pass of a network that other requests' drafters share."""

    def shared_pass(self, sequence: list[int], num_draft_tokens: int) -> tuple[BatchesPasses, int] | None:
        """(network drafter, k) when this step's draft is one pass of a shared network, so that the batch engine
        runs the passes of every such request as one forward (``propose_batch``); None: ``propose`` alone."""

    def drafted_by_shared_pass(self) -> None:
        """Told when this step's draft came from a shared pass instead of ``propose`` (for step counters)."""


@runtime_checkable
class DraftsAhead(Protocol):
    """A drafter that can draft the block after the one the target is verifying (the overlapped pipeline)."""

    def propose_ahead(self, sequence: list[int], block: list[int], num_draft_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None) -> Draft | None:
        """Pre-draft while the target verifies ``block`` (a chain following ``sequence``), assuming all of it is
        accepted: a chain whose first token is the guessed bonus token and whose next (at most)
        ``num_draft_tokens`` tokens draft the block after it; None when it cannot this time.

        Only a proposal: the pipeline uses it when the assumption came true (every draft accepted, bonus == the
        guess) and drops it otherwise, so it never affects the output, only speed. The drafter keeps no state that
        a later ``propose`` / ``observe`` of the true sequence would not repair (the rollback)."""


@runtime_checkable
class DraftsForFree(Protocol):
    """A drafter that sometimes knows tokens without running anything (a grammar's forced tokens): the batch engine
    proposes them where its planner grants no drafts, since they cost only their verification rows."""

    def free_draft(self, sequence: list[int]) -> Draft | None:
        """A chain to follow ``sequence`` that costs no drafter pass; None: nothing known for free."""


class ExtendsAhead:
    """:class:`DraftsAhead` for a drafter that needs no target states: it drafts from the extended sequence (one
    more token: the bonus guess)."""

    hidden_layers: tuple[int, ...]

    def propose_ahead(self, sequence: list[int], block: list[int], num_draft_tokens: int, params: SamplingParams,
                      generator: torch.Generator | None) -> Draft | None:
        if self.hidden_layers:
            return None
        draft = self.propose(sequence + block, num_draft_tokens + 1, params, generator)
        return None if draft.parents is not None or len(draft.tokens) == 0 else draft


# ---- what callers ask, through the capabilities ----------------------------------------------------------------


def for_request(drafter: Drafter) -> Drafter:
    """The drafter a new request decoded beside others gets: its own copy, or this one (no per-request state)."""
    return drafter.for_request() if isinstance(drafter, KeepsState) else drafter


def state_bytes(drafter: Drafter, capacity: int) -> int:
    """Memory a request's drafter reserves for ``capacity`` slots (0: it keeps no state)."""
    return drafter.state_bytes(capacity) if isinstance(drafter, KeepsState) else 0


def unread(drafter: Drafter, sequence: list[int]) -> int:
    """Ids the next ``propose`` reads before drafting (0: a drafter that does not read ids itself)."""
    return drafter.unread(sequence) if isinstance(drafter, CatchesUp) else 0


def runs_a_pass(drafter: Drafter, sequence: list[int], num_draft_tokens: int) -> bool:
    """Whether the next draft runs the drafter's network (every draft does, unless the drafter may look up)."""
    return drafter.runs_a_pass(sequence, num_draft_tokens) if isinstance(drafter, MayLookUp) else True


def free_draft(drafter: Drafter, sequence: list[int]) -> Draft | None:
    """The draft ``drafter`` offers without a pass (None: none, or it never does)."""
    return drafter.free_draft(sequence) if isinstance(drafter, DraftsForFree) else None


def shared_pass(drafter: Drafter, sequence: list[int], num_draft_tokens: int) -> tuple[BatchesPasses, int] | None:
    """(network drafter, k) when the next draft is a pass of a shared network; None: the drafter drafts alone."""
    return drafter.shared_pass(sequence, num_draft_tokens) if isinstance(drafter, SharesPasses) else None
