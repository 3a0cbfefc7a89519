"""The engine a user holds: target model, tokenizer, optional drafter; ``generate`` and ``stream``."""

from __future__ import annotations

import time
from typing import Callable, Iterator, Sequence

import torch

from dflash2.decode.output import GenerationResult, OutputTracker, StreamChunk
from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.models.decoder import Transformer
from dflash2.models.tokenizer import ChatMessages, Tokenizer
from dflash2.verify.sampling import SamplingParams

Prompt = str | ChatMessages
# A decoding method: (prompt ids [T], sampling, generator, KV capacity, stats) -> committed tokens per pass.
DecodeMethod = Callable[[torch.Tensor, SamplingParams, torch.Generator | None, int, DecodeStats], Iterator[list[int]]]


class Engine:
    """Generates from a target model, plainly or with a drafter (``drafter=None`` -> plain decoding)."""

    def __init__(self, target: Transformer, tokenizer: Tokenizer, *, drafter=None, name: str = "",
                 pipeline: str = "sync", adaptive_draft: bool = False, draft_threads: int | None = None) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.name = name
        self.pipeline = pipeline  # "sync" | "overlap" (see decode/overlap.py); read at each request
        self.adaptive_draft = adaptive_draft  # choose the draft length per step from observed acceptance
        self.draft_threads = draft_threads  # overlap: the drafter thread's intra-op threads (None: torch's default)
        self._worker = None  # overlap: the drafter's thread, started on first use

    @property
    def max_context(self) -> int:
        return self.target.config.max_position_embeddings

    def encode_prompt(self, prompt: Prompt, raw: bool = False) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            if raw or not self.tokenizer.has_chat_template:
                return self.tokenizer.encode(prompt)
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
        method: DecodeMethod | None = None,
    ) -> Iterator[StreamChunk]:
        """Yield text as it is committed; the generator's return value is the :class:`GenerationResult`."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        prompt_ids = self.encode_prompt(prompt, raw)
        if len(prompt_ids) >= self.max_context:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}")
        capacity = min(self.max_context, len(prompt_ids) + max_new_tokens + self._draft_slack())
        method = method or self._default_method()
        stats = DecodeStats(prompt_tokens=len(prompt_ids))
        generator = None if params.greedy else params.make_generator(self.target.device)
        steps = method(torch.tensor(prompt_ids), params, generator, capacity, stats)
        output = OutputTracker(self.tokenizer, max_new_tokens, stop)
        start = time.perf_counter()
        for step_ids in steps:
            if not output.generated:
                stats.prefill_seconds = time.perf_counter() - start
            chunk = output.push(step_ids)
            if chunk is not None:
                yield chunk
            if output.finish_reason is not None:
                break
        steps.close()
        stats.decode_seconds = time.perf_counter() - start - stats.prefill_seconds
        last, result = output.finish(output.finish_reason or "length", stats, prompt_ids)
        if last is not None:
            yield last
        return result

    def _default_method(self) -> DecodeMethod:
        if self.drafter is None:
            return lambda ids, params, gen, cap, stats: plain_decode(self.target, ids, params, gen, cap, stats)
        from dflash2.decode.draft_length import make_policy
        from dflash2.decode.overlap import PIPELINES, DraftWorker, overlap_decode
        from dflash2.decode.speculative import speculative_decode

        if self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; choose one of {', '.join(PIPELINES)}")
        drafter, overlap = self.drafter, self.pipeline == "overlap"

        def method(ids, params, gen, cap, stats):
            policy = make_policy(self.adaptive_draft, drafter.num_draft_tokens, overlap)
            if not overlap:
                return speculative_decode(self.target, drafter, ids, params, gen, cap, stats, policy)
            if self._worker is None or self._worker.num_threads != self.draft_threads:
                if self._worker is not None:
                    self._worker.close()
                self._worker = DraftWorker(self.target.device, self.draft_threads)
            return overlap_decode(self.target, drafter, ids, params, gen, cap, stats, self._worker, policy)

        return method

    def _draft_slack(self) -> int:
        """Extra KV slots a verification pass may write past the last kept token."""
        return 0 if self.drafter is None else self.drafter.max_draft_tokens + 1
