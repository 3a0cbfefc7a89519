"""Continuous batching: one loop verifies every running request in ONE ragged target forward per step.

Requests join (their prompt is prefilled as a row of the same forward) and leave (finished, cancelled) at every
step. Each request has its own sampling parameters, generator and draft length (0 = plain decoding); drafts are
chains or trees, checked with the same outcome, commit and stats functions as the single-request step
(``decode/speculative.py``), row by row, so the output of every request is what it would be alone (greedy: the
same tokens; sampling: the target's distribution).
KV memory is a :class:`~dflash2.kv.paged.PagedKVPool` with a fixed budget; admission reserves a request's
worst case, so a running request never runs out of blocks. With the prefix cache (on by default) a request starts
from the longest cached run of full blocks of its prompt (kept from earlier and running requests) and feeds only
the rest; a block drafter gets the cached positions' hidden states from the pool, the other drafters rebuild their
state from the prompt ids (``docs/serving.md``, "Prefix cache").
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time
from collections import deque
from typing import Iterator

import torch

from dflash2.decode.batch_types import (  # noqa: F401  (re-exported: the batch engine's public names)
    BatchConfig,
    BatchRequest,
    BatchRow,
    BatchSnapshot,
    DeadlineError,
    DrafterFactory,
    EngineStoppedError,
    Event,
    PrefixCacheSnapshot,
    QueueFullError,
    RequestHandle,
    RowDraft,
    Sink,
)
from dflash2.decode.engine import Engine
from dflash2.decode.output import GenerationResult, OutputTracker
from dflash2.decode.ragged import RaggedRow, ragged_forward
from dflash2.decode.batch_drafting import BatchDrafting
from dflash2.decode.cost_model import Acceptance, ForwardCost
from dflash2.decode.stats import DecodeStats
from dflash2.decode.step import Hidden, empty_draft, guided, prompt_observation, select_taps, settle
from dflash2.drafters.base import Draft, for_request, state_bytes
from dflash2.kernels.threads import release_openmp_pool
from dflash2.kv.paged import KVBudgetError, PagedKVPool
from dflash2.verify import choose_token

log = logging.getLogger("dflash2.batch")


class BatchEngine:
    """Owns the loop thread. ``submit`` from any thread; events reach each request's sink from the loop thread."""

    def __init__(self, engine: Engine, config: BatchConfig = BatchConfig(),
                 drafters: dict[str, DrafterFactory] | None = None) -> None:
        target = engine.target
        c = target.config
        self.engine = engine
        self.config = config
        self.drafters = dict(drafters or {})
        taps = prefix_tap_layers(engine) if config.prefix_cache else ()
        self.pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, config.num_blocks, config.block_size,
                                dtype=target.dtype, device=target.device, prefix_cache=config.prefix_cache,
                                tap_layers=taps, tap_width=c.hidden_size)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._incoming: list[BatchRow] = []
        self._waiting: deque[BatchRow] = deque()  # FIFO: only the head is admitted or timed out
        self._running: list[BatchRow] = []
        self._next_id = 0
        self._drafter_bytes = 0  # reserved by admitted requests' drafters
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._dead: BaseException | None = None  # why the loop thread ended, if it died
        self._finished: dict[str, int] = {}
        self._rejected = 0
        self._totals = DecodeStats()
        self._steps = 0
        self._workspace_peak = 0  # bytes: the largest padded attention workspace of a step (RaggedOutput)
        self.cost = ForwardCost()
        self.drafting = BatchDrafting(config.adaptive_drafts, self.cost, self._guard)

    # ---- the caller's side -------------------------------------------------------------------------------------
    def submit(self, request: BatchRequest, sink: Sink) -> RequestHandle:
        """Queue a request. Raises ValueError (bad request, too long for the context or the whole KV pool) or
        QueueFullError (too many waiting)."""
        self._check(request)
        if self._dead is not None or self._stop.is_set():
            raise EngineStoppedError("the engine is not running; restart the server")
        with self._lock:
            if len(self._incoming) + len(self._waiting) >= self.config.max_queue:
                self._rejected += 1
                raise QueueFullError(f"{self.config.max_queue} requests are already waiting; retry later")
            handle = RequestHandle(self._next_id)
            self._next_id += 1
            seq = self._new_row(request, handle, sink)
            self._check_drafter_memory(seq)
            self._incoming.append(seq)
        self._wake.set()
        return handle

    def max_slots(self, request: BatchRequest) -> int:
        """KV slots a request may use: prompt + new tokens + one draft block, within the model's context."""
        wanted = len(request.prompt_ids) + request.max_new_tokens + request.num_draft_tokens + 1
        return min(self.engine.max_context, wanted)

    def _check(self, request: BatchRequest) -> None:
        if request.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {request.max_new_tokens}")
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        if len(request.prompt_ids) >= self.engine.max_context:
            raise ValueError(f"the prompt has {len(request.prompt_ids)} tokens; the model's context is "
                             f"{self.engine.max_context}")
        if request.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {request.num_draft_tokens}")
        if request.timeout_s is not None and not request.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {request.timeout_s}")
        if request.num_draft_tokens and request.drafter not in self.drafters:
            held = ", ".join(sorted(self.drafters)) or "none"
            raise ValueError(f"drafter {request.drafter!r} is not loaded (loaded: {held})")
        need = self.pool.blocks_for(self.max_slots(request))
        if need > self.pool.num_blocks:
            raise ValueError(f"the request needs {need} KV blocks; the server's budget is {self.pool.num_blocks}")

    def _check_drafter_memory(self, seq: BatchRow) -> None:
        """Refuse a request whose drafter state alone exceeds the whole drafter memory budget."""
        budget = self.config.drafter_memory_bytes
        if seq.drafter is None or budget is None:
            return
        need = state_bytes(seq.drafter, self.max_slots(seq.request))
        if need > budget:
            raise ValueError(f"the request's drafter needs {need / 2**20:.1f} MiB for its caches; the server's "
                             f"drafter memory budget is {budget / 2**20:.1f} MiB")

    def _new_row(self, request: BatchRequest, handle: RequestHandle, sink: Sink) -> BatchRow:
        drafter = None
        if request.num_draft_tokens:
            drafter = guided(self.drafters[request.drafter](), request.constraint)
        generator = None if request.params.greedy else request.params.make_generator(self.engine.target.device)
        return BatchRow(request, handle, sink, time.perf_counter(), drafter, generator,
                         OutputTracker(self.engine.tokenizer, request.max_new_tokens, request.stop),
                         DecodeStats(prompt_tokens=len(request.prompt_ids)),
                         acceptance=Acceptance(pool=self.drafting.pooled(request.drafter, "network")),
                         lookup_acceptance=Acceptance(pool=self.drafting.pooled(request.drafter, "lookup")))

    def snapshot(self) -> BatchSnapshot:
        with self._lock:
            totals = copy.deepcopy(self._totals)
            cache, pool = self.pool.cache, self.pool
            prefix = None if cache is None else PrefixCacheSnapshot(cache.queried_tokens, cache.hit_tokens,
                                                                    cache.num_cached, cache.num_evictable)
            return BatchSnapshot(dict(self._finished), self._rejected, totals.prompt_tokens, totals.new_tokens,
                                 self._steps, totals, len(self._incoming) + len(self._waiting), len(self._running),
                                 pool.blocks_used, pool.num_blocks, self._drafter_bytes,
                                 self.config.drafter_memory_bytes, self._workspace_peak,
                                 self.config.attention_workspace_bytes, prefix)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the batch engine is already running")
        # the loop thread runs every forward from now on; the caller's OpenMP pool would only make libgomp throttle
        # both pools' spin-wait (kernels/threads.py: 1.2-1.75x slower products on 2 cores)
        release_openmp_pool()
        self._thread = threading.Thread(target=self._loop, name="dflash2-batch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The loop thread runs (False before ``start``, after ``stop`` or if the loop died)."""
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    def _loop(self) -> None:
        idle = True
        try:
            while not self._stop.is_set():
                try:
                    busy = self.step()
                except Exception as error:  # a bug outside every per-request guard: fail what runs, go on
                    log.exception("batch step failed; failing the requests it held")
                    for seq in list(self._running):
                        self._retire(seq, "error", error)
                    busy = True
                if not busy:
                    if not idle:  # an idle loop holds no OpenMP workers: another thread's work is not throttled
                        release_openmp_pool()
                    idle = True
                    self._wake.wait(0.05)
                    self._wake.clear()
                else:
                    idle = False
        except BaseException as error:  # the loop cannot go on: refuse new requests, fail the ones held
            self._dead = error
            log.critical("the batch engine loop stopped: %r", error)
            with self._lock:
                self._waiting.extend(self._incoming)
                self._incoming.clear()
            for seq in [*self._waiting, *self._running]:
                self._retire(seq, "error", EngineStoppedError("the engine stopped"))
            raise

    def step(self) -> bool:
        """Admit, run one ragged forward over every running request, emit, retire. False when idle.

        One request's failure (its drafter, its sampling, its row of the forward) fails that request only."""
        self._schedule()
        if not self._running:
            return False
        self._forward_and_advance(list(self._running))
        return True

    def _schedule(self) -> None:
        with self._lock:
            self._waiting.extend(self._incoming)
            self._incoming.clear()
        now = time.perf_counter()
        self._drop_cancelled_and_late(now)
        while self._waiting and len(self._running) < self.config.max_batch_size:
            if not self._admit(self._waiting[0]):
                break  # FIFO: the head waits for blocks (or drafter memory) to be freed
        # Submission times grow along the FIFO: only a head can have waited past the queue timeout.
        while self._waiting and now - self._waiting[0].submitted > self.config.queue_timeout_s:
            self._retire(self._waiting[0], "error", KVBudgetError(
                f"not admitted within {self.config.queue_timeout_s:.0f} s: the KV cache (or the drafter memory) "
                "stayed full"))

    def _can_reuse(self, seq: BatchRow) -> bool:
        """A cached prefix can start the request unless its drafter reads hidden states the pool does not keep
        (only a drafter factory given by hand, not one of ``request_drafters``, can: it then prefills in full)."""
        layers = () if seq.drafter is None else seq.drafter.hidden_layers
        return all(layer in self.pool.tap_layers for layer in layers)

    def _drop_cancelled_and_late(self, now: float) -> None:
        """Retire cancelled requests and those past their own deadline (any place in the queue: deadlines
        differ per request); one pass over the waiting and running requests."""
        for seq in [*self._waiting, *self._running]:
            if seq.handle.cancelled.is_set():
                self._retire(seq, "cancelled", None)
            elif seq.past_deadline(now):
                late = seq.table is None  # still waiting: never started
                self._retire(seq, "timeout", DeadlineError(f"not started within {seq.request.timeout_s:g} s")
                             if late else None)

    def _admit(self, seq: BatchRow) -> bool:
        """Move the head of the queue into the batch if its KV blocks and drafter memory can be reserved; a
        cached prefix of its prompt is taken over (its KV, and the hidden states a block drafter reads)."""
        try:
            seq.max_slots = self.max_slots(seq.request)
            seq.table = self.pool.new_table(seq.max_slots, seq.request.prompt_ids if self._can_reuse(seq) else None)
        except KVBudgetError:
            return False
        state = 0 if seq.drafter is None else state_bytes(seq.drafter, seq.max_slots)
        budget = self.config.drafter_memory_bytes
        if budget is not None and self._drafter_bytes + state > budget:
            seq.table.release()
            seq.table = None
            return False
        seq.state_bytes = state
        self._drafter_bytes += state
        self._waiting.popleft()
        seq.sequence = list(seq.request.prompt_ids)
        seq.stats.cached_tokens = seq.table.cached_tokens
        self._running.append(seq)
        with self._guard(seq, "admission"):
            if seq.drafter is not None:
                seq.drafter.reset(seq.max_slots)
                cached = seq.table.length
                if cached and seq.drafter.hidden_layers:  # as if it had observed the cached prompt chunk
                    seq.drafter.observe(seq.sequence[: cached + 1], -1,
                                        seq.table.read_taps(cached, seq.drafter.hidden_layers))
        return True

    def _forward_and_advance(self, running: list[BatchRow]) -> None:
        chunks = self._prefill_chunks(running)
        fed = [(seq, chunk) for seq, chunk in zip(running, chunks) if chunk != 0]  # rows out of budget wait
        running, chunks = [seq for seq, _ in fed], [chunk for _, chunk in fed]
        drafts = self.drafting.drafts(running, self.drafting.lengths(running, chunks))
        planned = [(seq, drafts[i], self._row(seq, drafts[i].draft, chunk))
                   for i, (seq, chunk) in enumerate(zip(running, chunks)) if i in drafts]
        if not planned:
            return
        outputs = self._target_forward(planned)
        for (seq, draft, row), out in zip(planned, outputs):
            if out is None:
                continue  # its row failed alone: already retired
            with self._guard(seq, "verification"):
                logits, hidden = out
                emitted = self._read_prompt(seq, row, logits, hidden) if not seq.prefilled else \
                    self._verify(seq, draft, logits, hidden)
                if emitted:
                    self._emit(seq, emitted)

    def _target_forward(self, planned: list[tuple[BatchRow, RowDraft, RaggedRow]]
                        ) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]] | None]:
        """One ragged forward over the planned rows -> per row (logits, hidden). If the batched forward fails,
        each row runs alone, so that only a row that fails by itself fails its request (that row's entry is None).
        A failed forward moves no table's committed length: the rows can simply be fed again."""
        rows = [row for _, _, row in planned]
        taps = tuple(sorted({layer for seq, _, _ in planned if seq.drafter for layer in seq.drafter.hidden_layers}
                            | set(self.pool.tap_layers)))
        started = time.perf_counter()
        try:
            out = ragged_forward(self.engine.target, self.pool, rows, hidden_layers=taps,
                                 workspace_bytes=self.config.attention_workspace_bytes)
        except Exception as error:
            if len(rows) == 1:
                self._fail(planned[0][0], "the target forward", error)
                return [None]
            log.warning("a batched forward of %d rows failed; running its rows one by one", len(rows),
                        exc_info=True)
            return [self._target_forward([entry])[0] for entry in planned]
        self.cost.record(sum(len(row.tokens) for row in rows), time.perf_counter() - started)
        with self._lock:
            self._steps += 1
            self._workspace_peak = max(self._workspace_peak, out.workspace_bytes)
        return list(zip(out.logits, out.hidden))

    @contextlib.contextmanager
    def _guard(self, seq: BatchRow, stage: str) -> Iterator[None]:
        """Run one request's part of a step: an exception fails (retires) that request and is not raised."""
        try:
            yield
        except Exception as error:
            self._fail(seq, stage, error)

    def _fail(self, seq: BatchRow, stage: str, error: Exception) -> None:
        log.error("request %d failed in %s", seq.handle.id, stage, exc_info=error)
        if seq in self._running or seq in self._waiting:
            self._retire(seq, "error", error)

    def _prefill_chunks(self, running: list[BatchRow]) -> list[int | None]:
        """Prompt tokens each prefilling row feeds this step (None for decode rows), first come first served
        within ``max_prefill_tokens``; the first prefilling row always gets at least one."""
        budget = self.config.max_prefill_tokens
        chunks: list[int | None] = []
        for seq in running:
            if seq.prefilled:
                chunks.append(None)
                continue
            chunk = min(len(seq.sequence) - seq.table.length, max(budget, 0))
            chunks.append(chunk)
            budget -= chunk
        return chunks

    @staticmethod
    def _row(seq: BatchRow, draft: Draft | None, chunk: int | None) -> RaggedRow:
        if chunk is not None:
            start = seq.table.length
            return RaggedRow(seq.table, seq.sequence[start : start + chunk], all_logits=False)
        tokens = [seq.sequence[-1]] + ([] if draft is None else draft.tokens.tolist())
        return RaggedRow(seq.table, tokens, all_logits=True, parents=None if draft is None else draft.parents)

    def _read_prompt(self, seq: BatchRow, row: RaggedRow, logits: torch.Tensor, hidden: Hidden) -> list[int]:
        """A prompt chunk was fed (logits [1, V] of its last id): the table keeps it; the first token once the whole
        prompt is read. A drafter that reads hidden states observes the chunk's (``hidden``: layer -> [1, T, D])."""
        start, drafter = seq.table.length, seq.drafter
        seq.table.rollback(start + len(row.tokens))
        self._keep(seq, start, hidden, len(row.tokens), seq.sequence)
        done = seq.table.length >= len(seq.sequence)
        constraint = seq.request.constraint
        if done and constraint is not None:  # the first token obeys the request's grammar too
            logits = constraint.constrain(empty_draft(), logits[-1:])
        emitted = [int(choose_token(logits[-1], seq.request.params, seq.generator))] if done else []
        if emitted and constraint is not None:
            constraint.advance(emitted)
        if drafter is not None and drafter.hidden_layers:
            taps = select_taps(drafter.hidden_layers, hidden, len(row.tokens))
            prompt_observation(seq.sequence[: seq.table.length + 1] + emitted, start, taps).tell(drafter)
        if drafter is not None and not self.config.adaptive_drafts:
            # a draft model reads the prompt's chunks with it (prefill, not a step); with adaptive drafts it reads
            # them at its first draft, if the planner ever grants one (a 0.5B drafter's prompt pass is ~1/4 of the
            # target's prefill, lost on a loaded server where drafting does not pay; the planner charges each
            # remaining step its share of that read)
            drafter.prefill(seq.sequence[: seq.table.length], len(seq.sequence))
        return emitted

    def _verify(self, seq: BatchRow, planned: RowDraft, logits: torch.Tensor, hidden: Hidden) -> list[int]:
        """logits [k + 1, V] over [pending, drafts...] -> the committed tokens; the table keeps the KV of the pending
        token and the accepted drafts, whose hidden states the drafter observes (``hidden``: layer -> [1, T, D])."""
        draft = planned.draft or empty_draft()
        layers = () if seq.drafter is None else seq.drafter.hidden_layers
        step = settle(draft, logits, hidden, cache=seq.table, start=seq.table.length, sequence=seq.sequence,
                      layers=layers, params=seq.request.params, generator=seq.generator, stats=seq.stats,
                      constraint=seq.request.constraint)
        self._keep(seq, step.start, hidden, step.outcome.kept_positions, step.observation.sequence)
        seq.acceptance_of(planned).update(draft.depth, step.observation.num_accepted)
        if seq.drafter is not None:
            step.observation.tell(seq.drafter)
        return step.outcome.emitted

    def _keep(self, seq: BatchRow, start: int, hidden: Hidden, kept: int | list[int], ids: list[int]) -> None:
        """After a commit from ``start``: store the kept positions' hidden states the pool keeps (for a later
        request's block drafter) and offer the newly full blocks (``ids``: the ids of the committed slots at
        least) to the prefix cache."""
        table = self.pool.cache is not None and seq.table
        if not table:
            return
        if self.pool.taps is not None:
            table.write_taps(start, select_taps(self.pool.tap_layers, hidden, kept))
        if table.length - table.frozen >= self.pool.block_size:
            table.publish(ids)

    def _emit(self, seq: BatchRow, emitted: list[int]) -> None:
        """Append committed tokens, send the new text, finish on EOS / stop string / max tokens / full context."""
        if not seq.output.generated:
            seq.stats.prefill_seconds = time.perf_counter() - seq.submitted
        seq.sequence.extend(emitted)
        chunk = seq.output.push(emitted)
        if chunk is not None:
            seq.send(chunk)
        if seq.output.finish_reason is not None:
            self._retire(seq, seq.output.finish_reason, None)
        elif seq.table.length >= seq.max_slots:
            self._retire(seq, "length", None)

    def _retire(self, seq: BatchRow, reason: str, error: Exception | None) -> None:
        """Leave the batch: free the KV blocks, count, and send the final event (none when cancelled)."""
        for group in (self._waiting, self._running):
            if seq in group:
                group.remove(seq)
        if seq.table is not None:
            seq.table.release()
        self._drafter_bytes -= seq.state_bytes
        seq.state_bytes = 0
        seq.finish_reason = reason
        stats = seq.stats
        stats.new_tokens = len(seq.output.generated)
        stats.decode_seconds = time.perf_counter() - seq.submitted - stats.prefill_seconds
        self._count(seq, reason)
        if error is not None:
            seq.send(error)
        elif reason != "cancelled":
            last, result = seq.output.finish(reason, stats, seq.request.prompt_ids)
            if last is not None:
                seq.send(last)
            seq.send(result)

    def _count(self, seq: BatchRow, reason: str) -> None:
        with self._lock:
            self._finished[reason] = self._finished.get(reason, 0) + 1
            self._totals.prompt_tokens += seq.stats.prompt_tokens if seq.table is not None else 0
            self._totals.add_decoding(seq.stats)


def prefix_tap_layers(engine: Engine) -> tuple[int, ...]:
    """The target layers the pool keeps per slot for the prefix cache: those the engine's drafter reads (the
    drafters ``request_drafters`` offers are it, its block drafter, and n-gram lookup, which reads none)."""
    return tuple(sorted(getattr(engine.drafter, "hidden_layers", ())))


def request_drafters(engine: Engine, max_draft_tokens: int | None = None) -> dict[str, DrafterFactory]:
    """The drafters a batch engine over ``engine`` can give each request, by name: ``ngram`` always (stateless,
    shared; at most ``max_draft_tokens`` drafts, default: its default draft length); the engine's own drafter, and
    when it is a ``+ngram`` hybrid also its block drafter alone, each copied per request by its ``for_request``
    (weights shared, its own cache). Only the drafters of this package are offered (DRAFTER_NAMES): each of them
    says by ``for_request`` what state it keeps. A drafter built with a tree width (``name:kxW``) drafts trees."""
    from dflash2.drafters.ngram import NgramDrafter
    from dflash2.drafters.spec import DRAFTER_NAMES, default_num_draft_tokens

    factories: dict[str, DrafterFactory] = {}
    held = engine.drafter
    for drafter in (held, getattr(held, "block", None)):  # a hybrid also serves its block drafter alone
        if drafter is not None and drafter.name in DRAFTER_NAMES and drafter.name not in factories:
            factories[drafter.name] = functools.partial(for_request, drafter)
    if "ngram" not in factories:  # the engine's own n-gram drafter (maybe a tree) when it holds one
        ngram = NgramDrafter(max_draft_tokens or default_num_draft_tokens("ngram"),
                             stop_ids=engine.tokenizer.eos_token_ids)
        factories["ngram"] = lambda: ngram
    return factories


def run_to_completion(batch: BatchEngine, requests: list[BatchRequest], join_every: int = 0) -> list[GenerationResult]:
    """Run requests on the calling thread (no loop thread): all at once, or one joining every ``join_every``
    steps. Returns their results in order; raises the first error a request got."""
    events: list[list[Event]] = [[] for _ in requests]
    pending = list(enumerate(requests))
    steps = 0
    while pending or batch._running or batch._waiting or batch._incoming:
        if pending and (join_every == 0 or steps % join_every == 0):
            for index, request in pending if join_every == 0 else pending[:1]:
                batch.submit(request, events[index].append)
            pending = [] if join_every == 0 else pending[1:]
        batch.step()
        steps += 1
    finals = [e[-1] for e in events]
    for final in finals:
        if isinstance(final, Exception):
            raise final
    return finals
