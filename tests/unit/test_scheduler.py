import pytest

from dflash2.decode.cost_model import Acceptance, ForwardCost
from dflash2.decode.scheduler import plan_draft_lengths


def test_drafts_are_granted_when_tokens_are_nearly_free():
    assert plan_draft_lengths([4, 4], [0.8, 0.8], base_tokens=2, base_expected=2.0, c0=1.0, c1=1e-4) == [4, 4]


def test_speculation_is_switched_off_when_the_forward_is_compute_bound():
    assert plan_draft_lengths([8] * 8, [0.3] * 8, base_tokens=8, base_expected=8.0, c0=0.01, c1=1.0) == [0] * 8


def test_better_accepted_requests_get_drafts_first():
    plan = plan_draft_lengths([4, 4], [0.9, 0.2], base_tokens=2, base_expected=2.0, c0=1.0, c1=0.1)
    assert plan[0] > plan[1] and plan[0] >= 2


def test_every_granted_draft_raises_expected_tokens_per_second():
    alphas, c0, c1 = [0.7, 0.5, 0.2], 1.0, 0.15
    plan = plan_draft_lengths([5, 5, 5], alphas, base_tokens=3, base_expected=3.0, c0=c0, c1=c1)

    def rate(p):
        expected = 3 + sum(sum(a ** i for i in range(1, k + 1)) for a, k in zip(alphas, p))
        return expected / (c0 + c1 * (3 + sum(p)))

    best = rate(plan)
    for row in range(3):  # no single draft more or fewer does better
        for delta in (-1, 1):
            other = list(plan)
            other[row] += delta
            if 0 <= other[row] <= 5:
                assert rate(other) <= best + 1e-12


def test_acceptance_counts_drafts_up_to_the_first_rejection():
    acceptance = Acceptance(decay=1.0)
    acceptance.update(4, 4)  # 4 tested, 4 accepted
    acceptance.update(4, 1)  # 2 tested, 1 accepted
    acceptance.update(0, 0)  # nothing drafted: no evidence
    assert acceptance.alpha == pytest.approx((5 + 1) / (6 + 2))


def test_cost_model_fits_a_line_and_keeps_the_prior_without_spread():
    model = ForwardCost(window=29, prior=(9.0, 9.0))
    for _ in range(10):
        model.record(4, 1.0)
    assert model.coefficients() == (9.0, 9.0)  # every step had the same size: nothing to fit
    for tokens in range(1, 30):  # the window now holds only these
        model.record(tokens, 0.02 + 0.001 * tokens)
    assert model.coefficients() == pytest.approx((0.02, 0.001))
