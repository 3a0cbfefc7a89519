"""How many tokens to draft next: a fixed k, or chosen per request from observed acceptance and measured costs.

Any draft length is lossless (verification decides what is kept), so the policy only trades speed. The adaptive
policy estimates the acceptance at each draft position with the loops' one estimator (``cost_model.Acceptance``:
``reach(i)``, the probability that draft i is accepted), and the cost of a step from measured draft and verify times
with their one forward cost model (``cost_model.ForwardCost``: a verification of k drafts costs ``relative(1 + k)``
plain steps, from the measured time of each size). Drafting costs per draft token (a draft model runs once per
token) or per pass (a block drafter fills k positions in one forward: ``Drafter.cost_per_pass``). It picks the k in
[0, k_max] that maximises

    expected tokens per step / expected seconds per step,   E(k) = 1 + reach(0) + ... + reach(k - 1)

Where the drafter gives each draft's probability (``Draft.confidence``: the PARD drafter), either policy also trims
each draft after it is made (:meth:`TrimmedDrafts.trim`): a node's chance of acceptance is the product of
``cost_model.Confidence`` rates along its path, and the verification keeps the likeliest n nodes for the n with the
most expected tokens per second, a verification of n + 1 rows priced by the measured cost of each size. So a step
verifies a long chain (or a wide tree) where the drafter is sure and one or two drafts where it guesses, within the
same pass.

k = 0 is plain decoding (speculation off). While off, nothing is drafted so nothing is learnt: every
``probe_interval`` steps one short probe draft refreshes the estimate; a probe that leaves speculation off doubles
the interval (up to ``max_probe_interval``): a probe costs more than a draft pass (the drafter first reads what it
missed while it was off, up to its catch-up window), so on text where drafts do not pay it should be rare. While on
at one length, the verification cost's growth with k cannot be fitted (every forward has the same size): every
``probe_interval`` steps one step drafts one token fewer (one more when k = 1), which costs about nothing. The
forward cost model is kept per context length (``cost_model.ContextCosts``: every row attends to the whole context)
and may be shared by the requests of one engine (the same target), so later requests start from a fit at their
length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash2 import platform
from dflash2.decode.cost_model import Acceptance, Confidence, ContextCosts, ForwardCost, StepCosts, nodes_tested
from dflash2.drafters.base import Draft
from dflash2.verify.sampling import SamplingParams


VERIFY_GROWTH = 0.05  # prior: a verification of k drafts costs (1 + VERIFY_GROWTH * k) plain steps
DRAFT_RATIO = 0.3  # prior: drafting's cost (per token, or per pass) relative to a plain step
# Cached positions from which a context's one-row cost is timed by a plain step rather than extrapolated from its
# verifications (TrimmedDrafts.times_one_row). Below, a second row costs little more than the line says (gguf, Zen 4:
# 1 / 2 rows 27 / 32 ms at 300 positions), and timing it there turned speculation off on MT-bench requests where it
# paid (4 of 6 decodes slower, 2026-12-07).
ONE_ROW_TIMED_FROM = 2048


class TrimmedDrafts:
    """What both policies share to trim a draft by its confidences (:meth:`trim`): the verification cost model by
    rows at the context length at hand (``forward``, fitted from the verifications seen at about that length; the
    loop says the length before each step, :meth:`at_context`), the cost of drafting relative to a plain step
    (``draft_ratio``, per pass or per draft token), and the acceptance by confidence (``confidence``)."""

    def __init__(self, forward: ForwardCost | ContextCosts | None, per_pass: bool, trim: bool, decay: float = 0.9,
                 draft_ratio: float = DRAFT_RATIO, verify_growth: float = VERIFY_GROWTH) -> None:
        # verification forwards over 1 + k tokens; without a shared model the prior (c0 + c1 = 1 plain step,
        # c1 = verify_growth) holds until the sizes seen vary enough for a fit
        if isinstance(forward, ForwardCost):
            forward = ContextCosts(single=forward)
        self.costs = forward or ContextCosts(prior=(1.0 - verify_growth, verify_growth))
        self.context = 0  # cached positions before the next verification
        self.per_pass, self.trims, self.decay = per_pass, trim, decay
        self.draft_ratio = draft_ratio  # seconds per draft token (or pass) / seconds per plain target step
        self.confidence = Confidence()  # acceptance by the drafter's own probability (drafts that carry one)

    @property
    def forward(self) -> ForwardCost:
        """The verification cost model at the current context length."""
        return self.costs.at(self.context)

    def at_context(self, cached: int) -> None:
        """The next verification follows ``cached`` positions (its rows are priced by forwards at that length)."""
        self.context = cached

    def times_one_row(self) -> bool:
        """Whether the next step should run plain, to time one row at a long context (from
        :data:`ONE_ROW_TIMED_FROM` cached positions): every verification seen there had more rows, so the plain step
        (the unit of every other cost) is only extrapolated from them, and there that errs most: a second row adds
        attention over every cached key (AMD EPYC Zen 4, gguf 1.5B, 7000 positions: 1 / 2 / 3 rows ~37 / ~60 /
        ~66 ms, the line through 2 and 3 rows says 54 for one), so steps of ~2.1 tokens for ~2.2 plain steps looked
        like a gain. Again whenever the window of forwards has let the one-row time go."""
        if self.context < ONE_ROW_TIMED_FROM:
            return False
        samples = self.forward.samples
        return bool(samples) and all(rows > 1 for rows, _ in samples)

    def draft_cost(self, k: int) -> float:
        """Drafting k tokens, in plain target steps."""
        return self.draft_ratio * (1 if self.per_pass else k)

    def trim(self, draft: Draft) -> Draft:
        """The part of ``draft`` worth verifying, by its nodes' confidences: nodes ranked by their chance of being
        accepted (the :class:`Confidence` rates multiplied along the path: a child never ranks above its parent,
        so every prefix of the ranking is a tree), the best n kept for the n in [1, nodes] that maximises expected
        tokens per step cost, the draft's pass being paid already. At least the likeliest node stays: one more row
        costs next to nothing where a row streams the weights, and a bin of confidences that is never verified
        would never learn (whether to draft at all, and how far, is ``next_length``'s call). A draft without
        confidences is kept whole, and so is every draft where trimming is off (the overlapped pipeline, whose
        pre-drafts are priced as a whole block, or ``DFLASH2_DRAFT_TRIM=off``)."""
        count = len(draft.tokens)
        if draft.confidence is None or count == 0 or not self.trims:
            return draft
        parents = list(range(-1, count - 1)) if draft.parents is None else draft.parents
        reach: list[float] = []
        for node, p in enumerate(draft.confidence.tolist()):
            reach.append(self.confidence.rate(p) * (1.0 if parents[node] < 0 else reach[parents[node]]))
        ranking = sorted(range(count), key=lambda node: -reach[node])  # stable: parents before their children
        paid, forward = self.draft_cost(count), self.forward
        best, best_rate, expected = 0, 0.0, 1.0
        for n in range(1, count + 1):
            expected += reach[ranking[n - 1]]
            rate = expected / (paid + forward.relative(1 + n))
            if rate > best_rate:
                best, best_rate = n, rate
        return keep_nodes(draft, sorted(ranking[:best]))

    def calibrate(self, draft: Draft, kept_positions: list[int]) -> None:
        """After a verification of ``draft``: count each tested node's outcome by its confidence."""
        if draft.confidence is None or len(draft.tokens) == 0:
            return
        confidence = draft.confidence.tolist()
        outcomes = nodes_tested(draft.parents, len(confidence), kept_positions)
        self.confidence.update([(confidence[node], hit) for node, hit in outcomes])

    def record_costs(self, num_drafted: int, draft_seconds: float, verify_seconds: float, rows: int) -> None:
        """A verification's measured times: the forward's by its rows, drafting's relative to a plain step."""
        forward = self.forward
        if verify_seconds > 0:
            forward.record(rows, verify_seconds)
        if num_drafted > 0 and draft_seconds > 0 and verify_seconds > 0:
            plain_step = verify_seconds / forward.relative(rows)
            measured = draft_seconds / plain_step / (1 if self.per_pass else num_drafted)
            self.draft_ratio = self.decay * self.draft_ratio + (1.0 - self.decay) * measured


class FixedDraftLength(TrimmedDrafts):
    """Always ``k`` drafts (capped by the room left in the cache), each draft trimmed by its confidences
    (:meth:`TrimmedDrafts.trim`) unless ``trim`` is off."""

    def __init__(self, k: int, forward: ForwardCost | ContextCosts | None = None, per_pass: bool = False,
                 trim: bool = True) -> None:
        if k < 0:
            raise ValueError(f"draft length must be >= 0, got {k}")
        super().__init__(forward, per_pass, trim)
        self.k = k

    def next_length(self, room: int) -> int:
        return max(0, min(self.k, room))

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               rows: int | None = None) -> None:
        """One verification (see :meth:`AdaptiveDraftLength.record`): only the costs are learnt, for trimming."""
        self.record_costs(num_drafted, draft_seconds, verify_seconds, 1 + num_drafted if rows is None else rows)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of :class:`AdaptiveDraftLength`; the defaults suit a drafter several times cheaper than the target."""

    k_max: int  # longest draft ever proposed
    overlap: bool = False  # drafting runs concurrently with verification (a hit hides the draft's cost)
    per_pass: bool = False  # drafting k tokens costs one pass whatever k (block drafters), not k
    decay: float = 0.9  # weight of the past in each position's acceptance counts (per observation)
    prior: float = 0.75  # acceptance assumed before any evidence (first position; later ones lean on the previous)
    prior_weight: float = 2.0  # pseudo-counts of that assumption
    verify_growth: float = VERIFY_GROWTH  # prior: a verification of k drafts costs (1 + verify_growth * k) plain steps
    draft_ratio: float = DRAFT_RATIO  # initial guess of drafting's cost (per token, or per pass) relative to a plain step
    probe_interval: int = 16  # steps with speculation off before one probe draft
    max_probe_interval: int = 128  # the interval after failed probes (it doubles per failed probe)
    probe_length: int = 2
    trim: bool = True  # trim each draft that carries confidences (:meth:`AdaptiveDraftLength.trim`)


class AdaptiveDraftLength(TrimmedDrafts):
    """Picks k per step from the acceptance and costs observed so far in this request; trims each draft by its
    confidences (:meth:`TrimmedDrafts.trim`) unless the config says not to or the pipeline overlaps."""

    def __init__(self, config: AdaptiveConfig, forward: ForwardCost | ContextCosts | None = None) -> None:
        if config.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {config.k_max}")
        super().__init__(forward, config.per_pass, config.trim and not config.overlap, config.decay,
                         config.draft_ratio, config.verify_growth)
        self.config = config
        self.acceptance = Acceptance(config.prior, config.prior_weight, config.decay)
        self.steps_off = 0
        self.steps_on = 0
        self.probe_interval = config.probe_interval  # grows while probes fail, back to the config's when one pays
        self.probed = False  # the last step was a probe

    def next_length(self, room: int) -> int:
        if self.times_one_row():
            return 0
        k = min(self.best_length(), room)
        probed, self.probed = self.probed, False
        if k > 0:
            self.steps_off = 0
            self.probe_interval = self.config.probe_interval
            self.steps_on += 1
            if self.steps_on % self.config.probe_interval == 0 and not self.forward.fitted():
                return k - 1 if k > 1 else min(2, self.config.k_max, room)  # another size for the cost fit
            return k
        if probed:
            self.probe_interval = min(2 * self.probe_interval, self.config.max_probe_interval)
        self.steps_off += 1
        if self.steps_off >= self.probe_interval:
            self.steps_off = 0
            self.probed = True
            return max(0, min(self.config.probe_length, self.config.k_max, room))
        return 0

    def best_length(self) -> int:
        """argmax over k in [0, k_max] of expected tokens per second (0 when speculation does not pay)."""
        return max(range(self.config.k_max + 1), key=lambda k: self.expected_tokens(k) / self.step_cost(k))

    def expected_tokens(self, k: int) -> float:
        return self.acceptance.expected_tokens(k)

    def step_cost(self, k: int) -> float:
        """Seconds of one step in units of a plain target step (decode/cost_model.py, slowdowns taken as 1)."""
        if k == 0:
            return 1.0
        hit_rate = self.acceptance.reach(k + 1)[-1]  # a hit: all k accepted and the bonus guessed like one more
        costs = StepCosts(draft_s=self.draft_cost(k), verify_s=self.forward.relative(1 + k), hit_rate=hit_rate,
                          ahead_s=self.draft_cost(k + 1), num_draft_tokens=k)  # ahead: the bonus guess + k drafts
        return costs.overlap_step() if self.config.overlap else costs.sync_step()

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float,
               rows: int | None = None) -> None:
        """One verification: ``num_drafted`` drafts deep (a tree's depth), the first ``num_accepted`` kept; the
        step's measured times (a step without drafts is a plain step: it only times the forward); ``rows``: the
        verification's rows, the pending token and every node (None: a chain's 1 + ``num_drafted``)."""
        self.record_costs(num_drafted, draft_seconds, verify_seconds, 1 + num_drafted if rows is None else rows)
        if num_drafted > 0:
            self.acceptance.update(num_drafted, num_accepted)


DraftLengthPolicy = FixedDraftLength | AdaptiveDraftLength


def keep_nodes(draft: Draft, nodes: list[int]) -> Draft:
    """The draft of ``nodes`` (ascending; every kept node's parent kept too): a chain's first n drafts stay a
    chain, a tree's nodes keep their parents, renumbered."""
    if nodes == list(range(len(draft.tokens))):
        return draft
    index = torch.tensor(nodes, dtype=torch.int64)
    q_draft = None if draft.q_draft is None else draft.q_draft[index.to(draft.q_draft.device)]
    confidence = None if draft.confidence is None else draft.confidence[index]
    parents = None
    if draft.parents is not None:
        renumbered = {node: i for i, node in enumerate(nodes)}
        parents = [-1 if draft.parents[node] < 0 else renumbered[draft.parents[node]] for node in nodes]
    elif nodes != list(range(len(nodes))):
        raise ValueError(f"a chain keeps a prefix of its drafts, not {nodes}")
    return Draft(tokens=draft.tokens[index], q_draft=q_draft, parents=parents, confidence=confidence)


def default_adaptive_draft(weights: str) -> bool:
    """Whether a single-request engine adapts its draft length by default: with ``weights="gguf"``, where a CPU
    verifies several rows of 4-bit blocks at much more than one row's cost (Zen 3, `auto`: HumanEval 2.32x vs 1.90x
    fixed, GSM8K 1.24x vs 1.00x, MT-bench 0.97x vs 0.83x; docs/pard.md); elsewhere the fixed, measured k."""
    return weights == "gguf"


def keeps_its_drafts(params: SamplingParams) -> bool:
    """Whether a request's drafts stay as drafted, at a fixed length: a seeded sampled request's, so that its random
    draws, hence its output, do not depend on timings (trimming and the adaptive length price steps by measured
    seconds). Greedy output is plain output whatever the drafts."""
    return not params.greedy and params.seed is not None


def make_policy(adaptive: bool, k_max: int, overlap: bool, per_pass: bool = False,
                forward: ForwardCost | ContextCosts | None = None, params: SamplingParams | None = None
                ) -> DraftLengthPolicy:
    """A fresh policy for one request (``per_pass``: the drafter's ``cost_per_pass``; ``forward``: the engine's
    verification cost model, shared by its requests; None: the request's own; ``params``: the request's sampling,
    a seeded sampled request keeping its drafts, :func:`keeps_its_drafts`)."""
    trim = platform.settings().draft_trim
    if params is not None and keeps_its_drafts(params):
        return FixedDraftLength(k_max, forward, per_pass, trim=False)
    if not adaptive:
        return FixedDraftLength(k_max, forward, per_pass, trim=trim and not overlap)
    return AdaptiveDraftLength(AdaptiveConfig(k_max=k_max, overlap=overlap, per_pass=per_pass, trim=trim), forward)


def verification_cost_model(growth: float = VERIFY_GROWTH) -> ContextCosts:
    """A verification cost model for an engine's requests to share, per context length (prior: a verification of
    k drafts costs ``1 + growth * k`` plain steps)."""
    return ContextCosts(prior=(1.0 - growth, growth))
