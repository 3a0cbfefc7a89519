"""The drafting half of a batch step (``decode/batch.py``): how many drafts each row gets (the adaptive planner,
``decode/scheduler.py``), and the drafts themselves. Requests whose drafts are passes of one network (each request's
pard drafter over the same 0.5B) draft in ONE forward of it per step (``Drafter.propose_batch``): its weights are
read once for the whole batch instead of once per request."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from collections.abc import Hashable
from typing import Callable

from dflash2.decode.batch_types import BatchRow, RowDraft
from dflash2.decode.cost_model import Acceptance, DraftCost, ForwardCost
from dflash2.decode.scheduler import RowDrafts, plan_draft_lengths
from dflash2.decode.step import fit_draft
from dflash2.drafters.base import Draft, Drafter, free_draft, runs_a_pass, shared_pass, unread
from dflash2.verify import SamplingParams

log = logging.getLogger("dflash2.batch")


class BatchDrafting:
    """Draft lengths and drafts of the running rows, with what drafting has cost so far (``costs``: per drafter
    name, shared by its requests, for drafters that draft alone; ``network_costs``: per shared network, the seconds
    of one pass by the ids fed). ``guard(seq, stage)`` runs one request's part: its failure retires that request
    only."""

    def __init__(self, adaptive: bool, forward_cost: ForwardCost,
                 guard: Callable[[BatchRow, str], AbstractContextManager[None]]) -> None:
        self.adaptive = adaptive
        self.cost = forward_cost
        self.guard = guard
        self.costs: dict[str, DraftCost] = {}
        self.network_costs: dict[Hashable, ForwardCost] = {}
        self.pools: dict[tuple[str, str], Acceptance] = {}

    def pooled(self, drafter: str, kind: str) -> Acceptance:
        """The acceptance by position of every request of ``drafter`` (kind: its network's drafts or its lookups):
        the prior of each new request's own (decaying slowly: it describes the drafter, not one request)."""
        return self.pools.setdefault((drafter, kind), Acceptance(decay=0.98))

    def lengths(self, running: list[BatchRow], chunks: list[int | None]) -> list[int]:
        """Drafts per row this step: the request's draft length within its KV room, lowered by the scheduler."""
        wanted = [min(seq.request.num_draft_tokens, seq.max_slots - len(seq.sequence))
                  if seq.prefilled and seq.drafter is not None else 0 for seq in running]
        if not self.adaptive or not any(wanted):
            return wanted
        base_tokens = sum(1 if chunk is None else chunk for chunk in chunks)
        rows = [self._row_drafts(seq, k) for seq, k in zip(running, wanted)]
        networks = {row.network: self._network_seconds(row.network) for row in rows if row.network is not None}
        plan = plan_draft_lengths(rows, base_tokens, float(len(running)), self.cost.seconds, networks)
        # A seeded sampled request keeps its draft length: its random draws, hence its output, stay reproducible
        # whatever else is in the batch.
        return [k if _seeded(seq.request.params) else p for seq, k, p in zip(running, wanted, plan)]

    def _row_drafts(self, seq: BatchRow, k: int) -> RowDrafts:
        if k <= 0:
            return RowDrafts(0, [])
        if not runs_a_pass(seq.drafter, seq.sequence, k):  # a lookup draft: only its verification rows cost
            return RowDrafts(k, seq.lookup_acceptance.reach(k))
        backlog = unread(seq.drafter, seq.sequence)
        steady = _steady_unread(seq, backlog, k)  # the rest is a backlog, read once: each step bears its share
        reads = steady + (backlog - steady) / _remaining_steps(seq, k)
        network = _network(seq, k)
        if network is not None:
            return RowDrafts(k, seq.acceptance.reach(k), network=network, reads=reads)
        cost = self._cost_of(seq)
        per_token = cost.seconds(2, 0) - cost.seconds(1, 0)  # what one more draft adds
        _, read_s = cost.coefficients()
        return RowDrafts(k, seq.acceptance.reach(k), cost.seconds(1, 0) - per_token + read_s * reads, per_token)

    def _network_seconds(self, key: Hashable) -> Callable[[float], float]:
        """Seconds of one shared pass fed N ids; 0 until the network's first pass is measured (try it, then know)."""
        cost = self.network_costs.get(key)
        return (lambda ids: 0.0) if cost is None or not cost.samples else cost.seconds

    def _record_network(self, key: Hashable, ids: int, seconds: float) -> None:
        self.network_costs.setdefault(key, ForwardCost()).record(ids, seconds)

    def _cost_of(self, seq: BatchRow) -> DraftCost:
        name = seq.request.drafter
        if name not in self.costs:
            self.costs[name] = DraftCost(per_pass=seq.drafter.cost_per_pass)
        return self.costs[name]

    def drafts(self, running: list[BatchRow], lengths: list[int]) -> dict[int, RowDraft]:
        """Each row's draft, by index in ``running``; a row whose drafting failed is left out (its request is
        retired). Drafts that are passes of one network shared by several requests (their pard
        drafters) run as ONE forward: the network's weights are read once per step, not once per request."""
        drafts: dict[int, RowDraft] = {}
        shared: dict[Hashable, list[tuple[int, Drafter, int, int]]] = {}
        for index, (seq, k) in enumerate(zip(running, lengths)):
            with self.guard(seq, "drafting"):
                network = shared_pass(seq.drafter, seq.sequence, k) if seq.prefilled and seq.drafter and k > 0 else None
                if network is None:
                    drafts[index] = self._propose(seq, k) if seq.prefilled else RowDraft(None)
                else:
                    drafter, drafter_k = network
                    shared.setdefault(_network_key(drafter), []).append((index, drafter, drafter_k, k))
        for key, members in shared.items():
            self._propose_shared(running, key, members, drafts)
        return drafts

    def _propose_shared(self, running: list[BatchRow], key: Hashable, members: list[tuple[int, Drafter, int, int]],
                        drafts: dict[int, RowDraft]) -> None:
        """One batched pass of network ``key`` for ``members`` (index in ``running``, network drafter, its k, the
        row's k), its time recorded by the ids it was fed. If the batched pass fails, each request drafts alone
        (only its own failure fails it)."""
        seqs = [running[index] for index, *_ in members]
        if len(members) > 1:
            backlogs = [unread(drafter, seq.sequence) for seq, (_, drafter, *_) in zip(seqs, members)]
            started = time.perf_counter()
            try:
                batch = type(members[0][1]).propose_batch(
                    [(drafter, seq.sequence, k, seq.request.params, seq.generator)
                     for seq, (_, drafter, k, _) in zip(seqs, members)])
            except Exception:
                log.warning("a batched draft pass of %d requests failed; drafting one by one", len(members),
                            exc_info=True)
            else:
                seconds = time.perf_counter() - started
                self._record_network(key, sum(backlogs) + sum(len(draft.tokens) for draft in batch), seconds)
                for seq, (index, *_), draft in zip(seqs, members, batch):
                    seq.drafter.drafted_by_shared_pass()
                    drafts[index] = RowDraft(self._fit(seq, draft))
                return
        for seq, (index, _, _, k) in zip(seqs, members):
            with self.guard(seq, "drafting"):
                drafts[index] = self._propose(seq, k, network=key)

    def _propose(self, seq: BatchRow, k: int, network: Hashable | None = None) -> RowDraft:
        """One request's draft alone; ``network``: the shared network whose pass this is (its time joins that
        network's cost curve), None for a drafter that drafts alone."""
        if seq.drafter is None:
            return RowDraft(None)
        if k <= 0:  # no drafts granted; tokens known without a pass (a grammar's forced ones) cost only their rows
            free = free_draft(seq.drafter, seq.sequence)
            return RowDraft(None) if free is None else RowDraft(self._fit(seq, free), by_lookup=True)
        timed = runs_a_pass(seq.drafter, seq.sequence, k)  # a lookup's ~0 s would blur the network's cost
        backlog, started = unread(seq.drafter, seq.sequence), time.perf_counter()
        draft = seq.drafter.propose(seq.sequence, k, seq.request.params, seq.generator)
        if not timed:
            return RowDraft(self._fit(seq, draft), by_lookup=True)
        seconds = time.perf_counter() - started
        if network is None:
            self._cost_of(seq).record(len(draft.tokens), backlog, seconds)
        else:
            self._record_network(network, backlog + len(draft.tokens), seconds)
        return RowDraft(self._fit(seq, draft))

    @staticmethod
    def _fit(seq: BatchRow, draft: Draft) -> Draft | None:
        room = seq.max_slots - len(seq.sequence)  # a tree of k * W nodes may not fit where k drafts do
        draft = fit_draft(draft, room)
        return draft if len(draft.tokens) else None


def _network_key(drafter: Drafter) -> Hashable:
    """Drafters of one network (the same model object) share its passes."""
    return type(drafter), id(getattr(drafter, "model", drafter))


def _network(seq: BatchRow, k: int) -> Hashable | None:
    """The network whose shared pass drafts this row's k drafts, or None (a lookup, a tree, a lone drafter)."""
    shared = shared_pass(seq.drafter, seq.sequence, k)
    return None if shared is None else _network_key(shared[0])


def _steady_unread(seq: BatchRow, backlog: int, k: int) -> int:
    """The ids a row that drafts every step reads per pass: those its last verification committed (about the
    expected tokens per step); any more are a backlog (its prompt, before its first draft; the ids it missed while
    it did not draft)."""
    return min(backlog, max(1, round(seq.acceptance.expected_tokens(k))))


def _remaining_steps(seq: BatchRow, k: int) -> float:
    """Steps the request has left if it drafts k per step: a backlog read once serves every one of them, so the
    planner charges each step its share (one step's price would never pay back a prompt read, and a request whose
    drafter never read its prompt could never draft)."""
    left = min(seq.request.max_new_tokens - len(seq.output.generated), seq.max_slots - len(seq.sequence))
    return max(1.0, left / seq.acceptance.expected_tokens(k))


def _seeded(params: SamplingParams) -> bool:
    return params.seed is not None and not params.greedy
