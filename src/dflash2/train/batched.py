"""Batched greedy generation for training data, with the target's tapped hidden states captured on the way.

Rows are left-padded to a common prompt length so that every row writes its next token to the same cache
slot; row ``b`` ignores its ``pad[b]`` leading slots through the attention mask, and its positions start at 0
after the padding. Each prompt is prefilled alone (no compute on padding) and its keys/values copied into its
row. One batched decode step costs little more than a batch-1 step on a memory-bound target
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

@dataclass
class BatchedResponse:
    response: list[int]  # generated ids, a stop id included and final when one was produced
    hidden: torch.Tensor | None  # [len(prompt) + len(response) - 1, num_taps, D] (None without taps)


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
    batch, width = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.int64)  # [B] leading padded slots per row
    capacity = width + max_new_tokens
    context = target.config.max_position_embeddings
    if width + max_new_tokens > context:
        raise ValueError(f"a prompt + {max_new_tokens} new tokens exceed the context of {context}")
    cache = target.new_cache(capacity, batch_size=batch)
    positions = (torch.arange(width)[None] - pad[:, None]).clamp(min=0)  # [B, P]
    next_ids, prompt_taps = _prefill_rows(target, prompts, cache, width, tuple(hidden_layers))
    taps = [prompt_taps] if hidden_layers else []  # each [B, T, taps, D]
    responses = torch.zeros(batch, 0, dtype=torch.int64)
    finished = torch.zeros(batch, dtype=torch.bool)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.int64)  # response length per row
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


def _prefill_rows(
    target: Transformer, prompts: Sequence[Sequence[int]], cache, width: int, hidden_layers: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prefill each prompt alone (no padded token is computed: prompts differ a lot in length, and the prefill is
    compute-bound) and copy its keys/values right-aligned into its row of the batched ``cache`` (slots
    ``[width - len, width)``; the padded slots stay masked). Returns the first greedy ids [B] and the prompts'
    tapped hidden states [B, width, taps, D] (zeros at the padding), or None without taps."""
    c = target.config
    first = torch.empty(len(prompts), dtype=torch.int64)
    taps = torch.zeros(len(prompts), width, len(hidden_layers), c.hidden_size, dtype=target.dtype) \
        if hidden_layers else None
    for row, prompt in enumerate(prompts):
        alone = target.new_cache(len(prompt))
        out = target(torch.tensor([list(prompt)], device=target.device), cache=alone, hidden_layers=hidden_layers,
                     logits="last")
        begin = width - len(prompt)
        cache.keys[:, row, :, begin:width] = alone.keys[:, 0]
        cache.values[:, row, :, begin:width] = alone.values[:, 0]
        first[row] = out.logits[0, -1].argmax().cpu()
        if taps is not None:
            taps[row, begin:] = _stack_taps(out.hidden_states)[0].cpu()
    cache.advance(width)
    return first, taps


def _stack_taps(hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
    """tuple of [B, T, D] -> [B, T, taps, D]."""
    return torch.stack(tuple(hidden_states), dim=2)
