"""The second half of every speculative step, written once: a verified draft -> committed tokens, statistics and
what the drafter observes.

Every loop (the single request's ``decode/speculative.py``, the overlapped ``decode/overlap.py``, the batch engine's
``decode/batch.py``) runs its own target pass over [pending, drafts...] and hands the logits and tapped hidden
states of that row to :func:`settle`, which decides what is kept (chain or tree: :func:`decide`, the one place
that tells them apart), commits the kept KV entries, counts the step and returns the drafter's
:class:`Observation`. The caller only says where the observation goes (a call, the drafter's thread).

A per-request :class:`LogitsConstraint` (e.g. a grammar) fits here: it masks the target's logits of the row
before the verdict and is told the committed tokens after it, in every loop alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import torch

from dflash2.decode.draft_length import DraftLengthPolicy
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft, Drafter
from dflash2.kv import KVCommit
from dflash2.verify import (
    SamplingParams,
    TreeLayout,
    compile_tree,
    logits_to_probs,
    verify_chain,
    verify_greedy,
    verify_tree,
    verify_tree_greedy,
)

Hidden = Mapping[int, torch.Tensor]  # tapped target layer -> [1, T, D] hidden states over a row's T inputs


@dataclass
class StepOutcome:
    emitted: list[int]  # accepted drafts, then the recovered-or-bonus token
    kept_positions: list[int]  # verify-input indices whose KV entries stay (0 = the pending token)


@dataclass
class Observation:
    """What a drafter observes after the target read a row: ``Drafter.observe``'s three arguments."""

    sequence: list[int]  # the committed sequence now; its last id is pending (not yet in the target's cache)
    num_accepted: int  # drafts accepted by the step; -1: a first prompt chunk (the drafter starts over)
    taps: tuple[torch.Tensor, ...]  # per drafter tap layer, [1, n, D] states of the n positions just kept

    def tell(self, drafter: Drafter) -> None:
        drafter.observe(self.sequence, self.num_accepted, self.taps)


@dataclass
class Settled:
    """One settled step."""

    outcome: StepOutcome
    observation: Observation
    start: int  # the cache's committed length before the step: the kept entries start here


class LogitsConstraint(Protocol):
    """A per-request rule on the target's next token (a grammar): it masks the logits of a row before verification
    and advances with what was committed. Lossless with respect to the constrained distribution: drafts are verified
    against the masked logits."""

    def constrain(self, draft: Draft, logits: torch.Tensor) -> torch.Tensor:
        """logits [n + 1, V] over [pending, drafts...] -> the same with disallowed ids at -inf (row i follows the
        draft path to input i: a chain's first i drafts, a tree's ancestors of node i - 1)."""

    def advance(self, emitted: list[int]) -> None:
        """The tokens the step committed (its state rolls back any speculative walk over the drafts)."""


@runtime_checkable
class GuidesDrafts(Protocol):
    """A constraint that also shapes the request's drafts (a grammar: its forced tokens, no forbidden ones): drafts
    are proposals only, so this changes speed, never the output."""

    def guide(self, drafter: Drafter) -> Drafter:
        """The request's drafter proposing under the constraint (``drafter`` itself when there is nothing to add)."""


def guided(drafter: Drafter | None, constraint: LogitsConstraint | None) -> Drafter | None:
    """The drafter a constrained request drafts with."""
    if drafter is None or not isinstance(constraint, GuidesDrafts):
        return drafter
    return constraint.guide(drafter)


def settle(
    draft: Draft,
    logits: torch.Tensor,  # [n + 1, V] the target's logits over [pending, drafts...]
    hidden: Hidden,  # at least the drafter's tap layers, over the same n + 1 inputs
    *,
    cache: KVCommit,  # holds the row's n + 1 entries from ``start`` on; keeps the accepted ones
    start: int,  # the cache's committed length before the target pass
    sequence: list[int],  # committed ids before the step (the last one pending)
    layers: tuple[int, ...],  # the drafter's tap layers (empty: it reads no hidden states)
    params: SamplingParams,
    generator: torch.Generator | None,
    stats: DecodeStats,
    policy: DraftLengthPolicy | None = None,
    draft_seconds: float = 0.0,  # the drafter's time for this draft (told to the policy)
    verify_started: float | None = None,  # perf_counter() when the target pass began; None: not timed
    constraint: LogitsConstraint | None = None,
) -> Settled:
    """Decide, commit the kept KV entries, count the step; the observation's sequence is ``sequence`` + emitted
    (a new list: the caller's is left as it was)."""
    outcome = decide(draft, logits, params, generator, constraint)
    commit_kept(cache, start, outcome.kept_positions)
    verify_seconds = 0.0
    if verify_started is not None:
        verify_seconds = time.perf_counter() - verify_started
        stats.verify_seconds += verify_seconds
    record_step(stats, policy, draft, outcome, draft_seconds, verify_seconds)
    if constraint is not None:
        constraint.advance(outcome.emitted)
    taps = select_taps(layers, hidden, outcome.kept_positions)
    observation = Observation(sequence + outcome.emitted, len(outcome.emitted) - 1, taps)
    return Settled(outcome, observation, start)


def prompt_observation(ids: list[int], start: int, taps: tuple[torch.Tensor, ...]) -> Observation:
    """The drafter's observation of prompt positions ``[start, start + n)`` the target has just read (``taps``:
    their states, [1, n, D] per layer). ``ids`` runs one past them: the id after them is pending (the first
    generated token after the last chunk, the next prompt id after an earlier one). The first chunk (start 0)
    starts the drafter's context over (num_accepted -1); a later chunk extends it like a step without drafts."""
    return Observation(ids, -1 if start == 0 else 0, taps)


def decide(draft: Draft, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
           constraint: LogitsConstraint | None = None) -> StepOutcome:
    """The verdict on a draft from the target's logits [n + 1, V]: the one place where chains and trees part."""
    if constraint is not None:
        logits = constraint.constrain(draft, logits)
    if draft.parents is None:
        return chain_outcome(draft.tokens, draft.q_draft, logits, params, generator)
    return tree_outcome(compile_tree(draft.parents), draft.tokens, logits, params, generator)


def select_taps(layers: tuple[int, ...], hidden: Hidden, kept: int | list[int]) -> tuple[torch.Tensor, ...]:
    """``layers`` of ``hidden`` over the first ``kept`` row positions, or the row positions ``kept`` (a tree's
    accepted branch): [1, n, D] each; empty for no layers."""
    if isinstance(kept, int):
        return tuple(hidden[layer][:, :kept] for layer in layers)
    index = torch.tensor(kept)
    return tuple(hidden[layer][:, index.to(hidden[layer].device)] for layer in layers)


def record_step(stats: DecodeStats, policy: DraftLengthPolicy | None, draft: Draft, outcome: StepOutcome,
                draft_seconds: float = 0.0, verify_seconds: float = 0.0) -> None:
    """Count one verification in the stats and tell the draft-length policy (if any) how it went."""
    stats.target_forwards += 1
    stats.committed_tokens += len(outcome.emitted)
    stats.record_draft(draft.depth, len(outcome.emitted) - 1)
    if policy is not None:
        policy.record(draft.depth, len(outcome.emitted) - 1, draft_seconds, verify_seconds, 1 + len(draft.tokens))
        policy.calibrate(draft, outcome.kept_positions)


def commit_kept(cache: KVCommit, start: int, kept_positions: list[int]) -> None:
    """Keep the KV entries of the accepted path: a chain is a rollback, a tree branch is compacted first."""
    if kept_positions == list(range(len(kept_positions))):
        cache.rollback(start + len(kept_positions))
    else:
        cache.compact(torch.tensor(kept_positions) + start, destination=start)


def empty_draft() -> Draft:
    """No drafts: the step is a plain target step."""
    return Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)


def fit_draft(draft: Draft, room: int) -> Draft:
    """Drop nodes that would not fit in the cache (a tree keeps a valid prefix: parents precede children)."""
    if len(draft.tokens) <= room:
        return draft
    q_draft = None if draft.q_draft is None else draft.q_draft[:room]
    parents = None if draft.parents is None else draft.parents[:room]
    confidence = None if draft.confidence is None else draft.confidence[:room]
    return Draft(tokens=draft.tokens[:room], q_draft=q_draft, parents=parents, confidence=confidence)


def tree_outcome(
    layout: TreeLayout,  # compile_tree(draft.parents)
    draft_ids: torch.Tensor,  # [n] int64 tree nodes
    logits: torch.Tensor,  # [n + 1, V] the target's logits over [pending, nodes...]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> StepOutcome:
    """The outcome of verifying a tree (siblings are deterministic drafts: the exact rule at T > 0)."""
    draft_ids = draft_ids.to(logits.device)
    if params.greedy:
        verdict = verify_tree_greedy(layout, draft_ids, logits)
    else:
        verdict = verify_tree(layout, draft_ids, logits_to_probs(logits, params), None, generator)
    return StepOutcome(verdict.tokens.tolist(), verdict.kept_positions)


def chain_outcome(
    draft_ids: torch.Tensor,  # [k] int64 (k may be 0: a plain step)
    q_draft: torch.Tensor | None,  # [k, V] the drafts' distributions; None = deterministic drafts
    logits: torch.Tensor,  # [k + 1, V] the target's logits over [pending, drafts...]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> StepOutcome:
    """The outcome of verifying a chain from the target's logits."""
    draft_ids = draft_ids.to(logits.device)
    if params.greedy:
        verdict = verify_greedy(draft_ids[None], logits[None])
    else:
        q = None if q_draft is None else q_draft[None].to(logits.device)  # [1, k, V]
        verdict = verify_chain(draft_ids[None], logits_to_probs(logits[None], params), q, generator)
    emitted = verdict.emitted(0)
    return StepOutcome(emitted, list(range(len(emitted))))
