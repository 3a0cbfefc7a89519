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
