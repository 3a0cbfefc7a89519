"""The engine a user holds: target model, tokenizer, optional drafter; ``generate`` and ``stream``.

Prefix reuse: after a generation ends normally, the engine keeps its KV cache and the ids its slots hold (one
sequence: the last conversation). The next call starts from the longest common prefix of those ids and its
prompt (at least the last prompt id is fed again), so a chat called turn after turn only prefills the new turn.
The drafter is reset and rebuilt from the full prompt ids (a block drafter from the hidden states the kept cache
holds for every committed slot). Not with the overlapped pipeline (it prefills in full).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from dflash2.decode.cost_model import ContextCosts
from dflash2.decode.output import GenerationResult, OutputTracker, StreamChunk
from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.kv.static import StaticKVCache
from dflash2.models.decoder import Transformer
from dflash2.models.tokenizer import ChatMessages, Tokenizer
from dflash2.verify.sampling import SamplingParams

if TYPE_CHECKING:
    from dflash2.decode.overlap import DraftWorker

Prompt = str | ChatMessages


@dataclass
class KeptCache:
    """The last generation's KV cache and the ids whose keys/values its slots ``[0, cache.length)`` hold."""

    cache: StaticKVCache
    ids: list[int]


class Engine:
    """Generates from a target model, plainly or with a drafter (``drafter=None`` -> plain decoding)."""

    def __init__(self, target: Transformer, tokenizer: Tokenizer, *, drafter=None, name: str = "",
                 pipeline: str = "sync", adaptive_draft: bool = False, draft_threads: int | None = None,
                 prefix_cache: bool = True) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.name = name
        self.pipeline = pipeline  # "sync" | "overlap" (see decode/overlap.py); read at each request
        self.adaptive_draft = adaptive_draft  # choose the draft length per step from observed acceptance
        self.draft_threads = draft_threads  # overlap: the drafter thread's intra-op threads (None: torch's default)
        self._worker = None  # overlap: the drafter's thread, started on first use
        self._verify_costs: dict[str, ContextCosts] = {}  # pipeline -> the draft-length policies' shared costs
        self.prefix_cache = prefix_cache  # keep the last generation's KV cache for the next call
        self._kept: KeptCache | None = None

    def clear_cache(self) -> None:
        """Forget the kept KV cache (its memory is freed)."""
        self._kept = None

    @property
    def max_context(self) -> int:
        return self.target.config.max_position_embeddings

    def encode_prompt(self, prompt: Prompt, raw: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if raw or not self.tokenizer.has_chat_template:
                return self.tokenizer.encode_prompt(prompt)
            return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        if not prompt:
            raise ValueError("the chat has no messages")
        return self.tokenizer.apply_chat_template(prompt)

    def generate(self, prompt: Prompt, **kwargs) -> GenerationResult:
        """Generate a completion. Keyword arguments: see :meth:`stream`."""
        stream = self.stream(prompt, **kwargs)
        while True:
            try:
                next(stream)
            except StopIteration as done:
                return done.value

    def stream(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        raw: bool = False,
    ) -> Iterator[StreamChunk]:
        """Yield text as it is committed; the generator's return value is the :class:`GenerationResult`."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        prompt_ids = self.encode_prompt(prompt, raw)
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        capacity = min(self.max_context, len(prompt_ids) + max_new_tokens + self._draft_slack())
        self._check_pipeline()
        stats = DecodeStats(prompt_tokens=len(prompt_ids))
        generator = None if params.greedy else params.make_generator(self.target.device)
        start = time.perf_counter()
        cache = self._start_cache(prompt_ids, capacity)
        stats.cached_tokens = 0 if cache is None else cache.length
        steps = self._decode(torch.tensor(prompt_ids), params, generator, capacity, stats, cache)
        output = OutputTracker(self.tokenizer, max_new_tokens, stop)
        committed = list(prompt_ids)
        for step_ids in steps:
            if not output.generated:
                stats.prefill_seconds = time.perf_counter() - start
            committed.extend(step_ids)
            chunk = output.push(step_ids)
            if chunk is not None:
                yield chunk
            if output.finish_reason is not None:
                break
        steps.close()
        if cache is not None:
            self._kept = KeptCache(cache, committed[: cache.length])
        stats.decode_seconds = time.perf_counter() - start - stats.prefill_seconds
        last, result = output.finish(output.finish_reason or "length", stats, prompt_ids)
        if last is not None:
            yield last
        return result

    def _start_cache(self, prompt_ids: list[int], capacity: int) -> StaticKVCache | None:
        """The cache this generation starts from: the kept one rolled back to its longest common prefix with the
        prompt (at most all prompt ids but the last), or a new one; None when nothing is kept (prefix reuse off,
        or the overlapped pipeline). The kept cache is taken: a generation that does not end normally keeps none."""
        kept, self._kept = self._kept, None
        if not self.prefix_cache or (self.drafter is not None and self.pipeline == "overlap"):
            return None
        taps = () if self.drafter is None else tuple(self.drafter.hidden_layers)
        if kept is None or kept.cache.tap_layers != taps:
            c = self.target.config
            return StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, dtype=self.target.dtype,
                                 device=self.target.device, tap_layers=taps, tap_width=c.hidden_size)
        common, limit = 0, min(len(kept.ids), len(prompt_ids) - 1)
        while common < limit and kept.ids[common] == prompt_ids[common]:
            common += 1
        kept.cache.rollback(common)
        return kept.cache.grown(capacity)

    def _check_pipeline(self) -> None:
        from dflash2.decode.overlap import PIPELINES

        if self.drafter is not None and self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; choose one of {', '.join(PIPELINES)}")

    def _decode(self, prompt_ids: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                capacity: int, stats: DecodeStats, cache: StaticKVCache | None) -> Iterator[list[int]]:
        """The committed tokens of each target pass: plain decoding, the speculative step, or its overlapped
        pipeline (``cache``: None, or one holding the KV of the prompt's first ``cache.length`` ids)."""
        if self.drafter is None:
            return plain_decode(self.target, prompt_ids, params, generator, capacity, stats, cache)
        from dflash2.decode.draft_length import make_policy, verification_cost_model
        from dflash2.decode.overlap import overlap_decode
        from dflash2.decode.speculative import speculative_decode

        drafter, overlap = self.drafter, self.pipeline == "overlap"
        forward = self._verify_costs.setdefault(self.pipeline, verification_cost_model())
        policy = make_policy(self.adaptive_draft, drafter.num_draft_tokens, overlap, drafter.cost_per_pass, forward,
                             params)
        if not overlap:
            return speculative_decode(self.target, drafter, prompt_ids, params, generator, capacity, stats, policy,
                                      cache)
        return overlap_decode(self.target, drafter, prompt_ids, params, generator, capacity, stats,
                              self._draft_worker(), policy)

    def _draft_worker(self) -> DraftWorker:
        """The overlapped pipeline's drafter thread, (re)started when its thread budget changed."""
        from dflash2.decode.overlap import DraftWorker

        if self._worker is None or self._worker.num_threads != self.draft_threads:
            if self._worker is not None:
                self._worker.close()
            self._worker = DraftWorker(self.target.device, self.draft_threads)
        return self._worker

    def _draft_slack(self) -> int:
        """Extra KV slots a verification pass may write past the last kept token."""
        return 0 if self.drafter is None else self.drafter.max_draft_tokens + 1
