"""How many tokens to draft next: a fixed k, or chosen per request from observed acceptance and measured costs.

Any draft length is lossless (verification decides what is kept), so the policy only trades speed. The adaptive
policy estimates the per-token acceptance rate ``beta`` with the loops' one estimator (``cost_model.Acceptance``),
and the cost of a step from measured draft and verify times with their one forward cost model
(``cost_model.ForwardCost``: a verification of k drafts is ``1 + growth * k`` plain steps), then picks the k in
[0, k_max] that maximises

    expected tokens per step / expected seconds per step,   E(k) = (1 - beta^(k + 1)) / (1 - beta)

k = 0 is plain decoding (speculation off). While off, nothing is drafted so nothing is learnt: every
``probe_interval`` steps one short probe draft refreshes the estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash2.decode.cost_model import Acceptance, ForwardCost, StepCosts


class FixedDraftLength:
    """Always ``k`` drafts (capped by the room left in the cache)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"draft length must be >= 0, got {k}")
        self.k = k

    def next_length(self, room: int) -> int:
        return max(0, min(self.k, room))

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Fixed: nothing to learn."""


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of :class:`AdaptiveDraftLength`; the defaults suit a drafter several times cheaper than the target."""

    k_max: int  # longest draft ever proposed
    overlap: bool = False  # drafting runs concurrently with verification (a hit hides the draft's cost)
    decay: float = 0.9  # weight of the past in the acceptance counts (per step)
    prior_accepted: float = 3.0  # pseudo-counts: start from beta = 0.75
    prior_rejected: float = 1.0
    verify_growth: float = 0.05  # prior: a verification of k drafts costs (1 + verify_growth * k) plain steps
    draft_ratio: float = 0.3  # initial guess of one draft token's cost relative to a plain target step
    probe_interval: int = 16  # steps with speculation off before one probe draft
    probe_length: int = 2


class AdaptiveDraftLength:
    """Picks k per step from the acceptance and costs observed so far in this request."""

    def __init__(self, config: AdaptiveConfig) -> None:
        if config.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {config.k_max}")
        self.config = config
        self.acceptance = Acceptance(config.prior_accepted, config.prior_rejected, config.decay)
        # verification forwards over 1 + k tokens; the prior (c0 + c1 = 1 plain step, c1 = verify_growth) holds
        # until the measured draft lengths vary enough for a fit
        self.forward = ForwardCost(prior=(1.0 - config.verify_growth, config.verify_growth))
        self.draft_ratio = config.draft_ratio  # seconds per draft token / seconds per plain target step
        self.steps_off = 0

    @property
    def beta(self) -> float:
        """Estimated probability that a draft is accepted given that the previous one was."""
        return self.acceptance.alpha

    def next_length(self, room: int) -> int:
        k = min(self.best_length(), room)
        if k > 0:
            self.steps_off = 0
            return k
        self.steps_off += 1
        if self.steps_off >= self.config.probe_interval:
            self.steps_off = 0
            return max(0, min(self.config.probe_length, self.config.k_max, room))
        return 0

    def best_length(self) -> int:
        """argmax over k in [0, k_max] of expected tokens per second (0 when speculation does not pay)."""
        return max(range(self.config.k_max + 1), key=lambda k: self.expected_tokens(k) / self.step_cost(k))

    def expected_tokens(self, k: int) -> float:
        beta = min(self.beta, 1.0 - 1e-6)
        return (1.0 - beta ** (k + 1)) / (1.0 - beta)

    def step_cost(self, k: int) -> float:
        """Seconds of one step in units of a plain target step (decode/cost_model.py, slowdowns taken as 1)."""
        if k == 0:
            return 1.0
        costs = StepCosts(draft_s=self.draft_ratio * k, verify_s=1.0 + self.forward.growth() * k,
                          hit_rate=self.beta ** (k + 1), num_draft_tokens=k)  # a hit: all k accepted, bonus guessed
        return costs.overlap_step() if self.config.overlap else costs.sync_step()

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """One verification: ``num_drafted`` drafts, the first ``num_accepted`` kept; the step's measured times."""
        if num_drafted <= 0:
            return
        self.acceptance.update(num_drafted, num_accepted)
        if draft_seconds > 0 and verify_seconds > 0:
            self.forward.record(1 + num_drafted, verify_seconds)
            plain_step = verify_seconds / (1.0 + self.forward.growth() * num_drafted)
            measured = draft_seconds / num_drafted / plain_step
            decay = self.config.decay
            self.draft_ratio = decay * self.draft_ratio + (1.0 - decay) * measured


DraftLengthPolicy = FixedDraftLength | AdaptiveDraftLength


def default_adaptive_draft(weights: str) -> bool:
    """Whether a single-request engine adapts its draft length by default: with ``weights="gguf"``, where a CPU
    verifies several rows of 4-bit blocks at much more than one row's cost (Zen 3, `auto`: HumanEval 2.32x vs 1.90x
    fixed, GSM8K 1.24x vs 1.00x, MT-bench 0.97x vs 0.83x; docs/pard.md); elsewhere the fixed, measured k."""
    return weights == "gguf"


def make_policy(adaptive: bool, k_max: int, overlap: bool) -> DraftLengthPolicy:
    """A fresh policy for one request."""
    return AdaptiveDraftLength(AdaptiveConfig(k_max=k_max, overlap=overlap)) if adaptive else FixedDraftLength(k_max)
