"""The drafter protocol: what a drafter needs from the target, and the three calls the speculative step makes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dflash2.verify.sampling import SamplingParams


@dataclass
class Draft:
    """A chain of k proposals, or a tree of n nodes when ``parents`` is given (several candidates at once)."""

    tokens: torch.Tensor  # [k] (chain) or [n] (tree nodes) int64 proposed ids; may be empty
    q_draft: torch.Tensor | None  # chain: [k, vocab] distributions the tokens were sampled from; None = deterministic
    parents: list[int] | None = None  # tree: parent node of each node (-1 = child of the pending token); None = chain

    @property
    def depth(self) -> int:
        """Longest path of drafts: k for a chain, the tree's depth for a tree."""
        if self.parents is None:
            return len(self.tokens)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)


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
        return self.num_draft_tokens

    def reset(self, capacity: int) -> None:
        """Start a new sequence; ``capacity`` bounds its length (prompt + generated + one draft block)."""

    def unread(self, sequence: list[int]) -> int:
        """Ids of ``sequence`` the next ``propose`` must read before drafting (a draft model's cache behind the
        sequence after steps without drafts): what resuming costs beyond a usual pass. 0: nothing to catch up."""
        return 0

    def runs_a_pass(self, sequence: list[int], num_draft_tokens: int) -> bool:
        """Whether drafting after ``sequence`` runs the drafter's network (False: a lookup that costs ~nothing)."""
        return True

    def shared_pass(self, sequence: list[int], num_draft_tokens: int) -> tuple[Drafter, int] | None:
        """(network drafter, k) when this step's draft is one pass of a network that other requests' drafters
        share, so that the batch engine can run their passes as ONE forward (``drafters.pard.propose_batch``);
        None: draft with :meth:`propose` alone."""
        return None

    def drafted_by_shared_pass(self) -> None:
        """Told when this step's draft came from a shared pass (:meth:`shared_pass`) instead of :meth:`propose`:
        for a drafter's own step counters."""

    @staticmethod
    def propose_batch(requests: list[tuple[Drafter, list[int], int, SamplingParams, torch.Generator | None]]
                      ) -> list[Draft]:
        """The drafts of several requests whose :meth:`shared_pass` named drafters of one network, each as its own
        ``propose`` would make it: (drafter, sequence, k, params, generator) per request. The default drafts them
        one by one; a drafter class that can batch its network's passes overrides this."""
        return [drafter.propose(sequence, k, params, generator) for drafter, sequence, k, params, generator in requests]

    def state_bytes(self, capacity: int) -> int:
        """Memory the per-request state of this drafter takes after ``reset(capacity)`` (its own caches; the
        weights are shared): what the batch engine reserves from its drafter memory budget. 0 = stateless."""
        return 0

    def held_bytes(self) -> int:
        """Memory its per-request state holds now (its ``cache``, if it keeps one)."""
        cache = getattr(self, "cache", None)
        return 0 if cache is None else cache.nbytes

    def for_request(self) -> Drafter:
        """A drafter like this one for another request decoded at the same time (the batch engine): the same
        weights and settings, its own per-sequence state. This one keeps no state, so it is shared; a drafter with
        state (a KV cache, a context) returns a new object."""
        return self

    @abstractmethod
    def propose(
        self, sequence: list[int], num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Draft at most ``num_draft_tokens`` tokens to follow ``sequence``."""

    def propose_ahead(
        self,
        sequence: list[int],
        block: list[int],
        num_draft_tokens: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft | None:
        """Pre-draft while the target verifies ``block`` (a chain following ``sequence``), assuming all of it is
        accepted: returns a chain whose first token is the guessed bonus token and whose next (at most)
        ``num_draft_tokens`` tokens draft the block after it; None when this drafter cannot draft ahead.

        The result is only a proposal: the pipeline uses it when the assumption came true (every draft accepted,
        bonus == the guess) and drops it otherwise, so it never affects the output, only speed. Drafters keep
        no state that a later ``propose`` / ``observe`` of the true sequence would not repair (the rollback).
        The default drafts from the extended sequence, which needs no target states (``hidden_layers`` empty).
        """
        if self.hidden_layers:
            return None
        draft = self.propose(sequence + block, num_draft_tokens + 1, params, generator)
        return None if draft.parents is not None or len(draft.tokens) == 0 else draft

    def prefill(self, prompt_ids: list[int], prompt_length: int | None = None) -> None:
        """During the target's prefill: committed prompt ids (a prefix of every later ``sequence``) that a drafter
        with its own context cache may read now, so that its first draft pass reads only the pending token and
        the prompt's cost counts as prefill (time to first token), as in every engine that runs a draft model.
        ``prompt_length``: the whole prompt's length when ``prompt_ids`` is only its first chunks (the batch
        engine's chunked prefill); None: ``prompt_ids`` is all of it.
        Optional: ``propose`` reads whatever the drafter has not seen, so skipping this changes only timing.
        The default reads nothing (a drafter without a cache, or one fed the target's hidden states)."""

    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """After prefill (num_accepted = -1) or a verification: ``sequence`` is the new committed sequence.

        target_hidden: for each of ``hidden_layers``, [1, n, D] states of the n positions the target has just
        written to its cache and kept (the prompt after prefill; the pending token + accepted drafts after a step).
        """
