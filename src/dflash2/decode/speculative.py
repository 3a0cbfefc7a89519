"""The speculative step for one request: propose, verify in one target pass, then settle (accept, commit or roll
back, count, observe: ``decode/step.py``, shared with the overlapped pipeline and the batch engine)."""

from __future__ import annotations

import time
from typing import Iterator

import torch

from dflash2.decode.draft_length import DraftLengthPolicy, make_policy
from dflash2.decode.stats import DecodeStats
from dflash2.decode.step import Hidden, empty_draft, fit_draft, prompt_observation, settle
from dflash2.drafters.base import Draft, Drafter
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify import SamplingParams, choose_token, compile_tree, target_positions, tree_attention_mask


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
    policy = policy or make_policy(False, drafter.num_draft_tokens, False, drafter.cost_per_pass, params=params)
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
    prompt_taps = cache.read_taps(cache.length) if reused and taps else out.hidden_states  # from position 0
    prompt_observation(sequence, 0, prompt_taps).tell(drafter)
    yield [token]  # the first token is the target's alone: it comes out before a draft model reads the prompt
    read_started = time.perf_counter()
    drafter.prefill(sequence[:-1])  # (reading it here, not in the first pass: the first step's draft costs as usual)
    stats.draft_seconds += time.perf_counter() - read_started  # (drafter time: a long prompt's read costs seconds)
    while cache.length < capacity:
        room = capacity - cache.length - 1  # slots left after the pending token
        started = time.perf_counter()
        policy.at_context(cache.length)
        k = policy.next_length(room)
        draft = fit_draft(policy.trim(drafter.propose(sequence, k, params, generator)), room) if k else empty_draft()
        drafted = time.perf_counter()
        stats.draft_seconds += drafted - started
        start = cache.length
        logits, hidden = verify_draft(target, cache, sequence[-1], draft, taps)
        step = settle(draft, logits, hidden, cache=cache, start=start, sequence=sequence, layers=taps, params=params,
                      generator=generator, stats=stats, policy=policy, draft_seconds=drafted - started,
                      verify_started=drafted)
        cache.write_taps(step.start, step.observation.taps)
        sequence = step.observation.sequence
        step.observation.tell(drafter)
        yield step.outcome.emitted


def verify_draft(
    target: Transformer,
    cache: StaticKVCache,
    pending: int,
    draft: Draft,
    taps: tuple[int, ...],
) -> tuple[torch.Tensor, Hidden]:
    """One target pass over [pending, drafts...] (a tree's nodes at their depths, each attending to its
    ancestors) -> its logits [n + 1, V] and the states of ``taps`` over the n + 1 inputs."""
    draft_ids = draft.tokens.to(target.device)  # [n]
    inputs = torch.cat([torch.tensor([pending], device=target.device), draft_ids])[None]  # [1, n + 1]
    if draft.parents is None:
        out = target(inputs, cache=cache, hidden_layers=taps)  # logits [1, k + 1, V]
    else:
        layout = compile_tree(draft.parents)
        positions = target_positions(layout, cache.length).to(target.device)[None]  # [1, n + 1]
        mask = tree_attention_mask(layout, cache.length).to(target.device)[None]  # [1, n + 1, S]
        out = target(inputs, positions=positions, cache=cache, attn_mask=mask, hidden_layers=taps)
    return out.logits[0], dict(zip(taps, out.hidden_states))
