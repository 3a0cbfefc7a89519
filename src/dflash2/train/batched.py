"""Batched greedy generation for training data, with the target's tapped hidden states captured on the way.

Rows are left-padded to a common prompt length so that every row writes its next token to the same cache
slot; row ``b`` ignores its ``pad[b]`` leading slots through the attention mask, and its positions start at 0
after the padding. One batched decode step costs little more than a batch-1 step on a memory-bound target
(the packed CPU kernel reads each weight once for all rows), so B rows come ~B times cheaper per token.

The hidden states that a forward pass computes anyway are kept: the prefill gives those of the prompt, each
decode step those of the token it feeds. A sequence of N ids therefore gets hidden states for its first N - 1
ids (the last id is never fed), which is all a drafter's context ever needs: a block anchored at ``a`` sees
positions ``< a <= N - 2``.

Greedy batched outputs equal batch-1 outputs up to floating-point reduction order in attention (exact for a
row-count invariant matmul path in fp32; tested on small models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from dflash2.models.decoder import Transformer

PAD_ID = 0  # any valid id: padded slots are never attended to by real tokens


@dataclass
class BatchedResponse:
    response: list[int]  # generated ids, a stop id included and final when one was produced
    hidden: torch.Tensor | None  # [len(prompt) + len(response) - 1, num_taps, D] (None without taps)


def _left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, P] left-padded with PAD_ID and pad [B] (number of leading pad slots per row)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.int64)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
    return ids, pad


def prefill_mask(pad: torch.Tensor, width: int) -> torch.Tensor:
    """[B, P, P] bool: causal, padded keys hidden; a padded query sees itself (keeps softmax finite)."""
    query = torch.arange(width)[:, None]
    key = torch.arange(width)[None, :]
    causal = key <= query  # [P, P]
    real_key = key[None] >= pad[:, None, None]  # [B, 1, P]
    return (causal[None] & real_key) | (key == query)[None]


@torch.no_grad()
def batched_greedy(
    target: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Iterable[int],
    hidden_layers: Sequence[int] = (),
) -> list[BatchedResponse]:
    """Greedy continuations of ``prompts`` in one batch (each stops at its first stop id or the token cap)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("batched_greedy needs at least one prompt and no empty prompt")
    device = target.device
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)
    ids, pad = _left_pad(prompts)  # [B, P], [B]
    batch, width = ids.shape
    capacity = width + max_new_tokens
    context = target.config.max_position_embeddings
    if max(len(p) for p in prompts) + max_new_tokens > context:
        raise ValueError(f"a prompt + {max_new_tokens} new tokens exceed the context of {context}")
    cache = target.new_cache(capacity, batch_size=batch)
    positions = (torch.arange(width)[None] - pad[:, None]).clamp(min=0)  # [B, P]
    out = target(ids.to(device), positions.to(device), cache, prefill_mask(pad, width).to(device),
                 hidden_layers=tuple(hidden_layers), logits="last")
    taps = [_stack_taps(out.hidden_states).cpu()] if hidden_layers else []  # each [B, T, taps, D]
    responses = torch.zeros(batch, 0, dtype=torch.int64)
    finished = torch.zeros(batch, dtype=torch.bool)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.int64)  # response length per row
    next_ids = out.logits[:, -1].argmax(dim=-1).cpu()  # [B]
    for step in range(max_new_tokens):
        responses = torch.cat([responses, next_ids[:, None]], dim=1)
        just_stopped = ~finished & torch.isin(next_ids, stop)
        lengths[just_stopped] = step + 1
        finished |= just_stopped
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        key_visible = torch.arange(cache.length + 1)[None, None, :] >= pad[:, None, None]  # [B, 1, S], S incl. new
        step_positions = (positions[:, -1:] + step + 1)  # [B, 1]
        out = target(next_ids[:, None].to(device), step_positions.to(device), cache, key_visible.to(device),
                     hidden_layers=tuple(hidden_layers), logits="last")
        if hidden_layers:
            taps.append(_stack_taps(out.hidden_states).cpu())
        next_ids = out.logits[:, -1].argmax(dim=-1).cpu()
    hidden = torch.cat(taps, dim=1) if taps else None  # [B, P + steps, taps, D]
    results = []
    for row in range(batch):
        response = responses[row, : int(lengths[row])].tolist()
        row_hidden = None
        if hidden is not None:
            kept = len(prompts[row]) + len(response) - 1
            row_hidden = hidden[row, int(pad[row]) : int(pad[row]) + kept].clone()
        results.append(BatchedResponse(response, row_hidden))
    return results


def _stack_taps(hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
    """tuple of [B, T, D] -> [B, T, taps, D]."""
    return torch.stack(tuple(hidden_states), dim=2)
