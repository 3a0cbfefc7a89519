"""Plain autoregressive decoding: the baseline every speculative method is measured against."""

from __future__ import annotations

from typing import Iterator

import torch

from dflash2.decode.stats import DecodeStats
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, choose_token


@torch.inference_mode()
def plain_decode(
    target: Transformer,
    prompt_ids: torch.Tensor,  # [T_prompt] int64
    params: SamplingParams,
    generator: torch.Generator | None,
    capacity: int,  # KV slots available: prompt + new tokens never exceed it
    stats: DecodeStats,
    cache: StaticKVCache | None = None,  # holds the KV of prompt_ids[:cache.length] (a reused prefix); None: new
) -> Iterator[list[int]]:
    """Yield the committed tokens of each target pass: the prefill's first token, then one per decode pass."""
    cache = target.new_cache(capacity) if cache is None else cache
    out = target(prompt_ids[None, cache.length :].to(target.device), cache=cache, logits="last")
    token = choose_token(out.logits[0, -1], params, generator)  # [] int64
    yield [int(token)]
    while cache.length < capacity:
        out = target(token.view(1, 1), cache=cache, logits="last")
        stats.target_forwards += 1
        stats.committed_tokens += 1
        token = choose_token(out.logits[0, -1], params, generator)
        yield [int(token)]
