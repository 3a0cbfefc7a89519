"""The overlapped pipeline: the drafter drafts block n + 1 while the target verifies block n.

Every drafter call runs on one worker thread (:class:`DraftWorker`), FIFO, so the drafter's state is only ever
touched by that thread. While the target verifies block n on the calling thread, the worker pre-drafts from the
optimistic outcome (all of block n accepted): a drafter that drafts ahead (``DraftsAhead``, drafters/base.py)
returns a guess of the bonus token and a draft of the block after it, kept in a :class:`SpeculationCache` keyed by
(accepted length, bonus token); any other drafter drafts only from the truth. When
the verdict matches a key (a hit) the next verification starts at once; otherwise (a miss) the pre-draft is
dropped, the drafter re-syncs to the true sequence (its rollback) and drafts from it while the target waits.

Lossless: a pre-draft is only a proposal, verified exactly like any other. At T > 0 the drafter samples with its
own generator (forked from the request's), so its draws are independent of the verification's; a pre-drafted
block was sampled from q given its assumed prefix, and on a hit that prefix is the true one.

Concurrency: on CPU each side has its own intra-op thread budget (``torch.set_num_threads`` sets the calling
thread's OpenMP budget; torch ops and the packed kernel release the GIL). On CUDA the worker runs on its own
stream: each call first waits (on the GPU) for what the caller's stream had queued, and synchronises its own
stream before handing results over. Nothing here assumes a CPU.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, TypeVar

import torch

from dflash2.decode.draft_length import DraftLengthPolicy, make_policy
from dflash2.decode.speculative import verify_draft
from dflash2.decode.step import StepOutcome, empty_draft, fit_draft, prompt_observation, settle
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.base import Draft, Drafter, DraftsAhead
from dflash2.models.decoder import Transformer
from dflash2.verify.sampling import SamplingParams, choose_token

PIPELINES = ("sync", "overlap")
Result = TypeVar("Result")


def default_pipeline(device: torch.device | str) -> str:
    """The pipeline a new engine uses: chosen by measurement (docs/overlap.md)."""
    return "sync"


def default_draft_threads(device: torch.device | str) -> int | None:
    """The drafter thread's intra-op budget: one core on CPU (the target keeps its own); unused on CUDA."""
    return 1 if torch.device(device).type == "cpu" else None


class DraftWorker:
    """One thread that runs every drafter call, with its own intra-op thread budget (CPU) or stream (CUDA)."""

    def __init__(self, device: torch.device | str, num_threads: int | None = None) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"drafter threads must be >= 1, got {num_threads}")
        self.device = torch.device(device)
        self.num_threads = num_threads
        self.busy_seconds = 0.0  # time spent running calls, summed (read by the pipeline for the bubble)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="dflash2-drafter", initializer=self._start)

    def _start(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)  # this thread's OpenMP budget only
        if self.device.type == "cuda":
            torch.cuda.set_stream(torch.cuda.Stream(self.device))  # the current stream is per thread

    def submit(self, fn: Callable[..., Result], *args) -> Future:
        """Queue a call; on CUDA it first waits for the work the caller's stream has queued so far (its inputs)."""
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return self._executor.submit(self._run, ready, fn, *args)

    def call(self, fn: Callable[..., Result], *args) -> Result:
        """Run on the worker and wait for the result."""
        return self.submit(fn, *args).result()

    def _run(self, ready, fn: Callable[..., Result], *args) -> Result:
        started = time.perf_counter()
        if ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ready)
        with torch.inference_mode():
            result = fn(*args)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # results are complete before hand-over
        with self._lock:
            self.busy_seconds += time.perf_counter() - started
        return result

    def close(self) -> None:
        self._executor.shutdown(wait=True)


@dataclass
class SpeculationCache:
    """Pre-drafted next blocks keyed by the verification outcome they assume: (accepted length, bonus token)."""

    entries: dict[tuple[int, int], Draft] = field(default_factory=dict)
    seconds: float = 0.0  # the drafter's time spent pre-drafting them

    def put(self, num_accepted: int, bonus: int, draft: Draft) -> None:
        self.entries[(num_accepted, bonus)] = draft

    def take(self, outcome: StepOutcome) -> Draft | None:
        """The pre-draft for the outcome that happened (None on a miss); the cache is emptied either way."""
        hit = self.entries.get((len(outcome.emitted) - 1, outcome.emitted[-1]))
        self.entries.clear()
        return hit


def _read_prompt(drafter: Drafter, sequence: list[int], hidden: tuple[torch.Tensor, ...]) -> None:
    """After the target's prefill (on the drafter's thread): the prompt's states, then the draft model's prefill."""
    prompt_observation(sequence, 0, hidden).tell(drafter)
    drafter.prefill(sequence[:-1])


@torch.inference_mode()
def overlap_decode(
    target: Transformer,
    drafter: Drafter,
    prompt_ids: torch.Tensor,  # [T_prompt] int64
    params: SamplingParams,
    generator: torch.Generator | None,
    capacity: int,  # KV slots for prompt + generated tokens + one draft block
    stats: DecodeStats,
    worker: DraftWorker,
    policy: DraftLengthPolicy | None = None,
) -> Iterator[list[int]]:
    """Like ``speculative_decode`` (same output distribution, token for token at T = 0), drafting concurrently."""
    policy = policy or make_policy(False, drafter.num_draft_tokens, True, drafter.cost_per_pass, params=params)
    stats.pipeline = "overlap"
    draft_generator = _fork(generator)
    busy_before = worker.busy_seconds
    pending: Future | None = None
    try:
        worker.call(drafter.reset, capacity + drafter.max_draft_tokens + 1)  # room for one block drafted ahead
        cache = target.new_cache(capacity)
        taps = drafter.hidden_layers
        out = target(prompt_ids[None].to(target.device), cache=cache, logits="last", hidden_layers=taps)
        sequence = prompt_ids.tolist() + [int(choose_token(out.logits[0, -1], params, generator))]
        pending = worker.submit(_read_prompt, drafter, list(sequence), out.hidden_states)
        yield sequence[-1:]
        draft: Draft | None = None  # the next block, when pre-drafted for the outcome that happened
        draft_seconds = 0.0  # the drafter's time for that block
        while cache.length < capacity:
            room = capacity - cache.length - 1
            policy.at_context(cache.length)
            k = policy.next_length(room)
            waited = time.perf_counter()
            if k == 0:
                draft = empty_draft()
            elif draft is None:  # a miss (or the first block): draft from the truth while the target waits
                draft = worker.call(drafter.propose, list(sequence), k, params, draft_generator)
                draft_seconds = time.perf_counter() - waited
            draft = fit_draft(fit_draft(draft, k) if draft.parents is None else draft, room)
            started = time.perf_counter()
            speculation = SpeculationCache()
            pending = _pre_draft(worker, drafter, sequence, draft, k, params, draft_generator, speculation)
            start = cache.length
            logits, hidden = verify_draft(target, cache, sequence[-1], draft, taps)
            step = settle(draft, logits, hidden, cache=cache, start=start, sequence=sequence, layers=taps, params=params,
                          generator=generator, stats=stats, policy=policy, draft_seconds=draft_seconds,
                          verify_started=started)
            if pending is not None:
                pending.result()  # the target's bubble when drafting ahead takes longer than verifying
            outcome, sequence = step.outcome, step.observation.sequence
            stats.predrafts += bool(speculation.entries)
            draft, draft_seconds = speculation.take(outcome), speculation.seconds
            stats.predraft_hits += draft is not None
            pending = worker.submit(step.observation.tell, drafter)
            yield outcome.emitted
    finally:
        if pending is not None:
            pending.result()  # never leave the drafter mid-call: the next request resets it
        stats.draft_seconds += worker.busy_seconds - busy_before


def _pre_draft(
    worker: DraftWorker,
    drafter: Drafter,
    sequence: list[int],
    draft: Draft,
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
    speculation: SpeculationCache,
) -> Future | None:
    """Start drafting the block after ``draft`` on the worker, assuming it is all accepted (chains only, by a
    drafter that drafts ahead)."""
    if k == 0 or draft.parents is not None or len(draft.tokens) == 0 or not isinstance(drafter, DraftsAhead):
        return None
    prefix, block = list(sequence), draft.tokens.tolist()  # snapshots: the caller extends ``sequence`` later

    def ahead() -> None:
        started = time.perf_counter()
        guess = drafter.propose_ahead(prefix, block, k, params, generator)
        if guess is not None and len(guess.tokens) > 1:
            q_draft = None if guess.q_draft is None else guess.q_draft[1:]
            speculation.put(len(block), int(guess.tokens[0]), Draft(tokens=guess.tokens[1:], q_draft=q_draft))
        speculation.seconds = time.perf_counter() - started

    return worker.submit(ahead)


def _fork(generator: torch.Generator | None) -> torch.Generator | None:
    """The drafter's own generator, seeded from the request's seed without drawing from it (independent draws,
    reproducible runs; the target's draws stay those of the sync pipeline)."""
    if generator is None:
        return None
    return torch.Generator(device=generator.device).manual_seed((generator.initial_seed() + 1) % 2**63)
