"""The batch engine's types: its configuration, a request and its handle, errors, the /metrics snapshot, and a
running request's row shared by the loop (``decode/batch.py``) and its drafting half (``decode/batch_drafting.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from dflash2.decode.cost_model import Acceptance
from dflash2.decode.output import GenerationResult, OutputTracker, StreamChunk
from dflash2.decode.ragged import DEFAULT_WORKSPACE_BYTES
from dflash2.decode.stats import DecodeStats
from dflash2.decode.step import LogitsConstraint
from dflash2.drafters.base import Draft, Drafter
from dflash2.kv.paged import BlockTable
from dflash2.verify import SamplingParams

Event = StreamChunk | GenerationResult | Exception  # what a request's sink receives, a result or error last
Sink = Callable[[Event], None]  # called from the loop thread; must not block
DrafterFactory = Callable[[], Drafter]  # a fresh drafter for one request (a stateless one may be shared)



class QueueFullError(RuntimeError):
    """Too many requests wait for admission (the server answers 429)."""


class DeadlineError(RuntimeError):
    """A request's deadline passed before it was admitted (the server answers 504)."""


class EngineStoppedError(RuntimeError):
    """The loop thread is not running (never started, stopped, or died): nothing will be generated."""


@dataclass(frozen=True)
class BatchConfig:
    max_batch_size: int = 16  # requests running at once
    num_blocks: int = 1024  # KV pool size (the fixed memory budget), in blocks
    block_size: int = 16  # slots per KV block
    max_queue: int = 64  # requests waiting for admission; more are refused (QueueFullError)
    queue_timeout_s: float = 60.0  # a request not admitted within this fails with KVBudgetError
    adaptive_drafts: bool = True  # lower draft lengths (to 0) when they would cost more than they commit
    max_prefill_tokens: int = 512  # prompt tokens fed per step (chunked prefill: running rows are not stalled)
    # Bytes the drafters' per-request state (their own KV caches) may take in all; admission reserves each
    # request's (Drafter.state_bytes) and a request waits while it does not fit. None: not bounded.
    drafter_memory_bytes: int | None = None
    prefix_cache: bool = True  # keep full KV blocks by the ids they hold; a request starts from its cached prefix
    # Attention's padded transient tensors per layer in one step (decode/ragged.py): rows are attended in groups
    # that stay within it (a row alone above it gets its own group).
    attention_workspace_bytes: int = DEFAULT_WORKSPACE_BYTES

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "num_blocks", "block_size", "max_prefill_tokens", "attention_workspace_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.drafter_memory_bytes is not None and self.drafter_memory_bytes < 0:
            raise ValueError(f"drafter_memory_bytes must be >= 0, got {self.drafter_memory_bytes}")


@dataclass
class BatchRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    drafter: str = "none"  # "none" or the name of a drafter the batch engine holds
    num_draft_tokens: int = 0  # drafts per step (0 = plain decoding)
    timeout_s: float | None = None  # from submission: a request not admitted by then fails (DeadlineError), a
    # running one finishes with what it has (finish reason "timeout")
    # a rule on the target's next token at every pass of this request, prefill's first token included (a grammar
    # mask, logprobs; serve/structured.py builds them)
    constraint: LogitsConstraint | None = None


class RequestHandle:
    """The caller's side of a submitted request: ``cancel()`` frees its resources at the next step."""

    def __init__(self, request_id: int) -> None:
        self.id = request_id
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class BatchSnapshot:
    """Counters and gauges for /metrics (read under the engine's lock)."""

    requests_finished: dict[str, int]  # finish reason (eos, stop, length, timeout, cancelled, error) -> count
    requests_rejected: int
    prompt_tokens: int
    generated_tokens: int
    steps: int  # ragged target forwards
    stats: DecodeStats  # decode rows pooled: target_forwards (row steps), committed tokens, acceptance by position
    queue_depth: int
    batch_size: int
    kv_blocks_used: int
    kv_blocks_total: int
    drafter_bytes_reserved: int
    drafter_bytes_budget: int | None
    attention_workspace_peak: int = 0  # the largest padded attention workspace of a step so far (bytes per layer)
    attention_workspace_budget: int = 0
    prefix_cache: PrefixCacheSnapshot | None = None  # None: the prefix cache is off


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    queried_tokens: int  # prompt tokens of admitted requests looked up in the cache
    hit_tokens: int  # of those, found cached (not computed again)
    blocks_cached: int  # blocks registered (held by running requests or evictable)
    blocks_evictable: int  # cached blocks no request holds


@dataclass
class BatchRow:
    """One request inside the loop: what it asked for, where its events go, its KV table, its drafter and what the
    scheduler has learnt about its drafts."""

    request: BatchRequest
    handle: RequestHandle
    sink: Sink
    submitted: float  # perf_counter() at submission
    drafter: Drafter | None  # its own (``for_request``), or None: plain decoding
    generator: torch.Generator | None  # None: greedy
    output: OutputTracker  # generated ids and text; the finish rule (EOS, stop strings, max_new_tokens)
    stats: DecodeStats
    table: BlockTable | None = None  # its KV slots once admitted
    max_slots: int = 0  # KV slots the request may fill (within the context; the table may round up to blocks)
    state_bytes: int = 0  # drafter memory reserved for it while admitted
    sequence: list[int] = field(default_factory=list)  # prompt + committed ids; the last one is pending
    finish_reason: str | None = None
    # acceptance by position of the drafts its drafter's network made, and of its lookup drafts (a hybrid drafter
    # makes both; their acceptance differs, and only the network's cost a pass)
    acceptance: Acceptance = field(default_factory=Acceptance)
    lookup_acceptance: Acceptance = field(default_factory=Acceptance)

    def send(self, event: Event) -> None:
        """Hand an event to the request's sink; a sink that fails (its client is gone) cancels the request."""
        try:
            self.sink(event)
        except Exception:
            self.handle.cancel()

    @property
    def prefilled(self) -> bool:
        return len(self.sequence) > len(self.request.prompt_ids)

    def past_deadline(self, now: float) -> bool:
        return self.request.timeout_s is not None and now - self.submitted > self.request.timeout_s

    def acceptance_of(self, draft: RowDraft) -> Acceptance:
        """Where the verdict on ``draft`` is learnt: its lookups' acceptance, or its network's."""
        return self.lookup_acceptance if draft.by_lookup else self.acceptance


@dataclass(frozen=True)
class RowDraft:
    """A row's draft for one step (``decode/batch_drafting.py`` -> the loop)."""

    draft: Draft | None  # None: no drafts (a plain step, or a prompt chunk)
    by_lookup: bool = False  # drafted by a lookup (prompt n-grams), not by the drafter's network
