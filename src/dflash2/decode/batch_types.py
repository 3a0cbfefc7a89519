"""The batch engine's public types: its configuration, a request and its handle, errors, and the /metrics
snapshot (``decode/batch.py`` holds the loop)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from dflash2.decode.output import GenerationResult, StreamChunk
from dflash2.decode.ragged import DEFAULT_WORKSPACE_BYTES
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Drafter
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
