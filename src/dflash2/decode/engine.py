"""The engine a user holds: target model, tokenizer, optional drafter; ``generate`` and ``stream``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from dflash2.decode.plain import plain_decode
from dflash2.decode.stats import DecodeStats
from dflash2.models.decoder import Transformer
from dflash2.models.tokenizer import ChatMessages, Tokenizer
from dflash2.verify.sampling import SamplingParams

Prompt = str | ChatMessages
# A decoding method: (prompt ids [T], sampling, generator, KV capacity, stats) -> committed tokens per pass.
DecodeMethod = Callable[[torch.Tensor, SamplingParams, torch.Generator | None, int, DecodeStats], Iterator[list[int]]]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids (the stop EOS excluded)
    finish_reason: str  # "eos" | "stop" (a stop string) | "length" (max_new_tokens or context limit) | "timeout"
    # (the server's per-request deadline)
    stats: DecodeStats
    prompt_ids: list[int] = field(default_factory=list)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty while a multi-byte character is incomplete)
    token_ids: list[int]  # ids committed by this target pass


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
        text_stream = _TextStream(self.tokenizer, stop)
        generated: list[int] = []
        finish_reason = "length"
        start = time.perf_counter()
        for step_ids in steps:
            if not generated:
                stats.prefill_seconds = time.perf_counter() - start
            step_ids, hit_eos = _cut_at_eos(step_ids, self.tokenizer.eos_token_ids)
            step_ids = step_ids[: max_new_tokens - len(generated)]
            generated.extend(step_ids)
            delta, hit_stop = text_stream.push(generated)
            if delta or step_ids:
                yield StreamChunk(text=delta, token_ids=step_ids)
            if hit_eos or hit_stop or len(generated) >= max_new_tokens:
                finish_reason = "stop" if hit_stop else ("eos" if hit_eos else "length")
                break
        steps.close()
        stats.decode_seconds = time.perf_counter() - start - stats.prefill_seconds
        stats.new_tokens = len(generated)
        tail = text_stream.flush()
        if tail:
            yield StreamChunk(text=tail, token_ids=[])
        return GenerationResult(text_stream.text, generated, finish_reason, stats, prompt_ids)

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


def _cut_at_eos(ids: list[int], eos_ids: frozenset[int]) -> tuple[list[int], bool]:
    for index, token in enumerate(ids):
        if token in eos_ids:
            return ids[:index], True
    return ids, False


class _TextStream:
    """Incremental detokenisation with stop strings: emits only text that is final."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # the final text (truncated before a stop string when one was hit)
        self.emitted = 0  # characters of ``text`` already yielded
        self.stopped = False

    def push(self, ids: list[int]) -> tuple[str, bool]:
        """Re-decode all ids; return (new final text, whether a stop string was hit)."""
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text)), True
        self.text = text
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD: hold it back
        held = max((_overlap(text[:safe], s) for s in self.stop), default=0)  # could start a stop string
        return self._take(safe - held), False

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
