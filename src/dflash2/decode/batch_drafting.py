"""The drafting half of a batch step (``decode/batch.py``): how many drafts each row gets (the adaptive planner,
``decode/scheduler.py``), and the drafts themselves. Requests whose drafts are passes of one network (each request's
pard drafter over the same 0.5B) draft in ONE forward of it per step (``Drafter.propose_batch``): its weights are
read once for the whole batch instead of once per request."""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from typing import Any, Callable

from dflash2.decode.cost_model import DraftCost, ForwardCost
from dflash2.decode.scheduler import RowDrafts, plan_draft_lengths
from dflash2.decode.speculative import fit_draft
from dflash2.drafters.base import Draft, Drafter
from dflash2.verify import SamplingParams

_Sequence = Any  # a running request: ``decode.batch._Sequence`` (not imported: batch.py imports this module)

log = logging.getLogger("dflash2.batch")


class BatchDrafting:
    """Draft lengths and drafts of the running rows, with what drafting has cost so far (``costs``: per drafter
    name, shared by its requests). ``guard(seq, stage)`` runs one request's part: its failure retires that
    request only."""

    def __init__(self, adaptive: bool, forward_cost: ForwardCost,
                 guard: Callable[[_Sequence, str], AbstractContextManager[None]]) -> None:
        self.adaptive = adaptive
        self.cost = forward_cost
        self.guard = guard
        self.costs: dict[str, DraftCost] = {}

    def lengths(self, running: list[_Sequence], chunks: list[int | None]) -> list[int]:
        """Drafts per row this step: the request's draft length within its KV room, lowered by the scheduler."""
        wanted = [min(seq.request.num_draft_tokens, seq.max_slots - len(seq.sequence))
                  if seq.prefilled and seq.drafter is not None else 0 for seq in running]
        if not self.adaptive or not any(wanted):
            return wanted
        base_tokens = sum(1 if chunk is None else chunk for chunk in chunks)
        rows = [self._row_drafts(seq, k) for seq, k in zip(running, wanted)]
        plan = plan_draft_lengths(rows, base_tokens, float(len(running)), self.cost.seconds)
        # A seeded sampled request keeps its draft length: its random draws, hence its output, stay reproducible
        # whatever else is in the batch.
        return [k if _seeded(seq.request.params) else p for seq, k, p in zip(running, wanted, plan)]

    def _row_drafts(self, seq: _Sequence, k: int) -> RowDrafts:
        if k <= 0:
            return RowDrafts(0, [])
        if not seq.drafter.runs_a_pass(seq.sequence, k):  # a lookup draft: only its verification rows cost
            return RowDrafts(k, seq.lookup_acceptance.reach(k))
        cost, unread = self._cost_of(seq), seq.drafter.unread(seq.sequence)
        per_token = cost.seconds(2, 0) - cost.seconds(1, 0)  # what one more draft adds
        return RowDrafts(k, seq.acceptance.reach(k), cost.seconds(1, unread) - per_token, per_token)

    def _cost_of(self, seq: _Sequence) -> DraftCost:
        name = seq.request.drafter
        if name not in self.costs:
            self.costs[name] = DraftCost(per_pass=seq.drafter.cost_per_pass)
        return self.costs[name]

    def drafts(self, running: list[_Sequence], lengths: list[int]) -> dict[int, Draft | None]:
        """Each row's draft (None: no draft), by index in ``running``; a row whose drafting failed is left out (its
        request is retired). Drafts that are passes of one network shared by several requests (their pard
        drafters) run as ONE forward: the network's weights are read once per step, not once per request."""
        drafts: dict[int, Draft | None] = {}
        shared: dict[tuple[type, int], list[tuple[int, Drafter, int, int]]] = {}
        for index, (seq, k) in enumerate(zip(running, lengths)):
            with self.guard(seq, "drafting"):
                network = seq.drafter.shared_pass(seq.sequence, k) if seq.prefilled and seq.drafter and k > 0 else None
                if network is None:
                    drafts[index] = self._propose(seq, k) if seq.prefilled else None
                else:
                    drafter, drafter_k = network
                    key = (type(drafter), id(getattr(drafter, "model", drafter)))
                    shared.setdefault(key, []).append((index, drafter, drafter_k, k))
        for members in shared.values():
            self._propose_shared(running, members, drafts)
        return drafts

    def _propose_shared(self, running: list[_Sequence], members: list[tuple[int, Drafter, int, int]],
                        drafts: dict[int, Draft | None]) -> None:
        """One batched pass for ``members`` (index in ``running``, network drafter, its k, the row's k); each
        request is charged an equal share of its time. If the batched pass fails, each request drafts alone (only
        its own failure fails it)."""
        seqs = [running[index] for index, *_ in members]
        if len(members) > 1:
            unread = [drafter.unread(seq.sequence) for seq, (_, drafter, *_) in zip(seqs, members)]
            started = time.perf_counter()
            try:
                batch = type(members[0][1]).propose_batch(
                    [(drafter, seq.sequence, k, seq.request.params, seq.generator)
                     for seq, (_, drafter, k, _) in zip(seqs, members)])
            except Exception:
                log.warning("a batched draft pass of %d requests failed; drafting one by one", len(members),
                            exc_info=True)
            else:
                share = (time.perf_counter() - started) / len(members)
                for seq, (index, *_), draft, behind in zip(seqs, members, batch, unread):
                    seq.drafted_by_lookup = False
                    seq.drafter.drafted_by_shared_pass()
                    self._cost_of(seq).record(len(draft.tokens), behind, share)
                    drafts[index] = self._fit(seq, draft)
                return
        for seq, (index, _, _, k) in zip(seqs, members):
            with self.guard(seq, "drafting"):
                drafts[index] = self._propose(seq, k)

    def _propose(self, seq: _Sequence, k: int) -> Draft | None:
        if seq.drafter is None or k <= 0:
            return None
        timed = seq.drafter.runs_a_pass(seq.sequence, k)  # a lookup's ~0 s would blur the network's cost
        seq.drafted_by_lookup = not timed
        unread, started = seq.drafter.unread(seq.sequence), time.perf_counter()
        draft = seq.drafter.propose(seq.sequence, k, seq.request.params, seq.generator)
        if timed:
            self._cost_of(seq).record(len(draft.tokens), unread, time.perf_counter() - started)
        return self._fit(seq, draft)

    @staticmethod
    def _fit(seq: _Sequence, draft: Draft) -> Draft | None:
        room = seq.max_slots - len(seq.sequence)  # a tree of k * W nodes may not fit where k drafts do
        draft = fit_draft(draft, room)
        return draft if len(draft.tokens) else None


def _seeded(params: SamplingParams) -> bool:
    return params.seed is not None and not params.greedy
