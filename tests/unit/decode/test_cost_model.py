"""The sync / overlap cost model: limits that follow from the formulas."""

from __future__ import annotations

import pytest

from dflash2.decode.cost_model import StepCosts, break_even_slowdown


def test_perfect_overlap_hides_the_cheaper_side():
    costs = StepCosts(draft_s=1.0, verify_s=1.0, hit_rate=1.0, ahead_s=1.0)
    assert costs.sync_step() == 2.0 and costs.overlap_step() == 1.0 and costs.overlap_speedup() == 2.0


def test_all_misses_only_add_the_concurrent_time():
    costs = StepCosts(draft_s=1.0, verify_s=2.0, hit_rate=0.0, ahead_s=1.0)
    assert costs.overlap_step() == 3.0 and costs.overlap_speedup() == 1.0  # pre-drafting was free but useless


def test_sharing_the_hardware_can_make_overlap_lose():
    gpu = StepCosts(draft_s=1.1, verify_s=1.0, hit_rate=0.6, num_draft_tokens=4)
    cpu = StepCosts(draft_s=1.1, verify_s=1.0, hit_rate=0.6, num_draft_tokens=4, target_slowdown=1.8,
                    drafter_slowdown=1.8)
    assert gpu.ahead == pytest.approx(1.1 * 5 / 4)
    assert gpu.overlap_speedup() > 1.0 > cpu.overlap_speedup()
    s = break_even_slowdown(gpu)
    even = StepCosts(draft_s=1.1, verify_s=1.0, hit_rate=0.6, target_slowdown=s, drafter_slowdown=s)
    assert even.overlap_speedup() == pytest.approx(1.0)


def test_one_estimator_and_one_cost_model_serve_both_loops():
    """The adaptive draft length and the batch planner share the acceptance estimator and the forward cost model:
    the same observations give the same acceptance rate, and measured verification times set the growth."""
    from dflash2.decode.cost_model import Acceptance, ForwardCost
    from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength

    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=8, prior=0.5, prior_weight=2.0, decay=0.9))
    alone = Acceptance(prior=0.5, prior_weight=2.0, decay=0.9)
    for drafted, accepted in [(4, 4), (4, 1), (2, 0), (6, 6)]:
        policy.record(drafted, accepted, 0.01, 0.1 + 0.02 * drafted)
        alone.update(drafted, accepted)
    assert isinstance(policy.acceptance, Acceptance) and isinstance(policy.forward, ForwardCost)
    assert policy.acceptance.rates(8) == alone.rates(8)
    for k in (1, 3, 5, 7) * 2:  # verification seconds = 0.08 + 0.02 * (1 + k): growth 0.02 / 0.1
        policy.record(k, k, 0.01, 0.08 + 0.02 * (1 + k))
    assert policy.forward.growth() == pytest.approx(0.2)
    assert policy.step_cost(4) == pytest.approx(policy.draft_ratio * 4 + 1.0 + 0.2 * 4)
