"""The speculative step: propose, verify in one target pass, accept, commit or roll back, observe."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from dflash2.decode.draft_length import DraftLengthPolicy, FixedDraftLength
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft, Drafter
from dflash2.kv import KVCommit
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify import (
    SamplingParams,
    TreeLayout,
    choose_token,
    compile_tree,
    logits_to_probs,
    target_positions,
    tree_attention_mask,
    verify_chain,
    verify_greedy,
    verify_tree,
    verify_tree_greedy,
)


@dataclass
class StepOutcome:
    emitted: list[int]  # accepted drafts, then the recovered-or-bonus token
    kept_positions: list[int]  # verify-input indices whose KV entries stay (0 = the pending token)


@torch.inference_mode()
def speculative_decode(
    target: Transformer,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [T_prompt] int64
    params: SamplingParams,
    generator: torch.Generator | None,
    capacity: int,  # KV slots for prompt + generated tokens + one draft block
    stats: DecodeStats,
    policy: DraftLengthPolicy | None = None,  # draft length per step (default: always drafter.num_draft_tokens)
    cache: StaticKVCache | None = None,  # holds the KV of prompt_ids[:cache.length] (a reused prefix); None: new
) -> Iterator[list[int]]:
    """Yield the tokens committed by each target pass. Lossless: the output is distributed as plain decoding's.

    A cache that keeps hidden states (``cache.tap_layers`` == the drafter's) keeps those of every committed slot;
    a drafter that reads hidden states can start from a reused prefix only through them."""
    policy = policy or FixedDraftLength(drafter.num_draft_tokens)
    taps = drafter.hidden_layers
    cache = target.new_cache(capacity) if cache is None else cache
    reused = cache.length
    if reused and taps and cache.tap_layers != taps:
        raise ValueError(f"a reused prefix needs the hidden states of layers {taps}; the cache keeps "
                         f"{cache.tap_layers}")
    drafter.reset(capacity)
    out = target(prompt_ids[None, reused:].to(target.device), cache=cache, logits="last", hidden_layers=taps)
    cache.write_taps(reused, out.hidden_states)
    token = int(choose_token(out.logits[0, -1], params, generator))
    sequence = prompt_ids.tolist() + [token]  # the last id is pending: committed, not yet in the target cache
    drafter.observe(sequence, -1, cache.read_taps(cache.length) if reused and taps else out.hidden_states)
    drafter.prefill(sequence[:-1])  # a draft model reads the prompt now: prefill time, not the first step's
    yield [token]
    while cache.length < capacity:
        room = capacity - cache.length - 1  # slots left after the pending token
        started = time.perf_counter()
        k = policy.next_length(room)
        draft = fit_draft(drafter.propose(sequence, k, params, generator), room) if k else empty_draft()
        drafted = time.perf_counter()
        start = cache.length
        outcome, hidden = verify_draft(target, cache, sequence[-1], draft, params, generator, taps)
        commit_kept(cache, start, outcome.kept_positions)
        verified = time.perf_counter()
        stats.draft_seconds += drafted - started
        stats.verify_seconds += verified - drafted
        record_step(stats, policy, draft, outcome, drafted - started, verified - drafted)
        sequence.extend(outcome.emitted)
        kept = torch.tensor(outcome.kept_positions, device=target.device)
        kept_taps = tuple(h[:, kept] for h in hidden)
        cache.write_taps(start, kept_taps)
        drafter.observe(sequence, len(outcome.emitted) - 1, kept_taps)
        yield outcome.emitted


def record_step(stats: DecodeStats, policy: DraftLengthPolicy | None, draft: Draft, outcome: StepOutcome,
                draft_seconds: float = 0.0, verify_seconds: float = 0.0) -> None:
    """Count one verification in the stats and tell the draft-length policy (if any) how it went; every loop
    records its steps with this one function."""
    stats.target_forwards += 1
    stats.committed_tokens += len(outcome.emitted)
    stats.record_draft(draft.depth, len(outcome.emitted) - 1)
    if policy is not None:
        policy.record(draft.depth, len(outcome.emitted) - 1, draft_seconds, verify_seconds)


def empty_draft() -> Draft:
    """No drafts: the step is a plain target step."""
    return Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)


def fit_draft(draft: Draft, room: int) -> Draft:
    """Drop nodes that would not fit in the cache (a tree keeps a valid prefix: parents precede children)."""
    if len(draft.tokens) <= room:
        return draft
    q_draft = None if draft.q_draft is None else draft.q_draft[:room]
    parents = None if draft.parents is None else draft.parents[:room]
    return Draft(tokens=draft.tokens[:room], q_draft=q_draft, parents=parents)


def commit_kept(cache: KVCommit, start: int, kept_positions: list[int]) -> None:
    """Keep the KV entries of the accepted path: a chain is a rollback, a tree branch is compacted first."""
    if kept_positions == list(range(len(kept_positions))):
        cache.rollback(start + len(kept_positions))
    else:
        cache.compact(torch.tensor(kept_positions) + start, destination=start)


def verify_draft(
    target: Transformer,
    cache: StaticKVCache,
    pending: int,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    taps: tuple[int, ...],
) -> tuple[StepOutcome, tuple[torch.Tensor, ...]]:
    """One target pass over [pending, drafts...]; returns the outcome and the taps of all n + 1 inputs."""
    draft_ids = draft.tokens.to(target.device)  # [n]
    inputs = torch.cat([torch.tensor([pending], device=target.device), draft_ids])[None]  # [1, n + 1]
    if draft.parents is None:
        out = target(inputs, cache=cache, hidden_layers=taps)  # logits [1, k + 1, V]
        return chain_outcome(draft_ids, draft.q_draft, out.logits[0], params, generator), out.hidden_states
    layout = compile_tree(draft.parents)
    positions = target_positions(layout, cache.length).to(target.device)[None]  # [1, n + 1]
    mask = tree_attention_mask(layout, cache.length).to(target.device)[None]  # [1, n + 1, S]
    out = target(inputs, positions=positions, cache=cache, attn_mask=mask, hidden_layers=taps)
    return tree_outcome(layout, draft_ids, out.logits[0], params, generator), out.hidden_states


def tree_outcome(
    layout: TreeLayout,  # compile_tree(draft.parents)
    draft_ids: torch.Tensor,  # [n] int64 tree nodes
    logits: torch.Tensor,  # [n + 1, V] the target's logits over [pending, nodes...]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> StepOutcome:
    """The outcome of verifying a tree (siblings are deterministic drafts: the exact rule at T > 0); the
    single-request loops and the batch engine decide with this one function."""
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
    """The outcome of verifying a chain from the target's logits: every loop (single request, overlapped,
    batched) decides what to keep with this one function."""
    draft_ids = draft_ids.to(logits.device)
    if params.greedy:
        verdict = verify_greedy(draft_ids[None], logits[None])
    else:
        q = None if q_draft is None else q_draft[None].to(logits.device)  # [1, k, V]
        verdict = verify_chain(draft_ids[None], logits_to_probs(logits[None], params), q, generator)
    emitted = verdict.emitted(0)
    return StepOutcome(emitted, list(range(len(emitted))))
