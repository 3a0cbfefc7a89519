"""The speculative step: propose, verify in one target pass, accept, commit or roll back, observe."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft, Drafter
from dflash2.models.decoder import Transformer
from dflash2.verify import ChainVerdict, SamplingParams, choose_token, logits_to_probs, verify_chain, verify_greedy


@torch.inference_mode()
def speculative_decode(
    target: Transformer,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [T_prompt] int64
    params: SamplingParams,
    generator: torch.Generator | None,
    capacity: int,  # KV slots for prompt + generated tokens + one draft block
    stats: DecodeStats,
) -> Iterator[list[int]]:
    """Yield the tokens committed by each target pass. Lossless: the output is distributed as plain decoding's."""
    taps = drafter.hidden_layers
    cache = target.new_cache(capacity)
    drafter.reset(capacity)
    out = target(prompt_ids[None].to(target.device), cache=cache, logits="last", hidden_layers=taps)
    token = int(choose_token(out.logits[0, -1], params, generator))
    sequence = prompt_ids.tolist() + [token]  # the last id is pending: committed, not yet in the target cache
    drafter.observe(sequence, -1, out.hidden_states)
    yield [token]
    while cache.length < capacity:
        room = capacity - cache.length - 1  # slots left after the pending token
        started = time.perf_counter()
        draft = drafter.propose(sequence, min(drafter.num_draft_tokens, room), params, generator)
        drafted = time.perf_counter()
        verdict, hidden = _verify(target, cache, sequence[-1], draft, params, generator, taps)
        stats.draft_seconds += drafted - started
        stats.verify_seconds += time.perf_counter() - drafted
        num_accepted = int(verdict.num_accepted[0])
        emitted = verdict.tokens[0, : num_accepted + 1].tolist()
        cache.rollback(cache.length - len(draft.tokens) + num_accepted)  # keep pending + accepted drafts
        stats.target_forwards += 1
        stats.record_draft(len(draft.tokens), num_accepted)
        sequence.extend(emitted)
        drafter.observe(sequence, num_accepted, tuple(h[:, : num_accepted + 1] for h in hidden))
        yield emitted


def _verify(
    target: Transformer,
    cache,
    pending: int,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None,
    taps: tuple[int, ...],
) -> tuple[ChainVerdict, tuple[torch.Tensor, ...]]:
    """One target pass over [pending, drafts...]; returns the verdict and the taps of those k + 1 positions."""
    draft_ids = draft.tokens.to(target.device)  # [k]
    inputs = torch.cat([torch.tensor([pending], device=target.device), draft_ids])[None]  # [1, k + 1]
    out = target(inputs, cache=cache, hidden_layers=taps)  # logits [1, k + 1, V]
    if params.greedy:
        return verify_greedy(draft_ids[None], out.logits), out.hidden_states
    p_target = logits_to_probs(out.logits, params)  # [1, k + 1, V]
    q_draft = None if draft.q_draft is None else draft.q_draft[None].to(target.device)  # [1, k, V]
    return verify_chain(draft_ids[None], p_target, q_draft, generator), out.hidden_states
