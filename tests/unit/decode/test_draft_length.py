"""Draft-length policies: the adaptive one follows acceptance and costs, switches speculation off and probes."""

from __future__ import annotations

import pytest

from dflash2.decode.draft_length import AdaptiveConfig, AdaptiveDraftLength, FixedDraftLength, make_policy


def feed(policy: AdaptiveDraftLength, steps: int, accepted: int, drafted: int, draft_s=0.01, verify_s=0.1) -> None:
    for _ in range(steps):
        policy.record(drafted, accepted, draft_s, verify_s)


def test_fixed_length_is_capped_by_the_room_left():
    assert FixedDraftLength(4).next_length(room=10) == 4
    assert FixedDraftLength(4).next_length(room=2) == 2
    with pytest.raises(ValueError):
        FixedDraftLength(-1)


def test_full_acceptance_with_cheap_drafts_drafts_the_longest_block():
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=8))
    feed(policy, 30, accepted=8, drafted=8)
    assert min(policy.acceptance.rates(8)) > 0.95
    assert policy.next_length(room=100) == 8
    assert policy.next_length(room=3) == 3


def test_everything_rejected_switches_speculation_off_then_probes_less_and_less_often():
    config = AdaptiveConfig(k_max=8, probe_interval=2, probe_length=2, max_probe_interval=8)
    policy = AdaptiveDraftLength(config)
    feed(policy, 30, accepted=0, drafted=4, draft_s=0.03)
    assert policy.acceptance.first < 0.05
    lengths = []
    for _ in range(30):
        lengths.append(policy.next_length(room=100))
        policy.record(lengths[-1], 0, 0.03, 0.1)  # every probe rejected
    probes = [step for step, k in enumerate(lengths) if k]
    assert all(lengths[step] == 2 for step in probes)
    assert probes[0] == 1 and [b - a for a, b in zip(probes, probes[1:])] == [4, 8, 8, 8]  # periods 2, 4, 8 (cap)


def test_probe_that_succeeds_turns_speculation_back_on():
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=6, probe_interval=1))
    feed(policy, 30, accepted=0, drafted=4)
    assert policy.best_length() == 0
    feed(policy, 30, accepted=2, drafted=2)  # probes are now all accepted
    assert policy.best_length() >= 4


def test_expensive_drafts_shorten_the_block():
    cheap, costly = AdaptiveDraftLength(AdaptiveConfig(k_max=12)), AdaptiveDraftLength(AdaptiveConfig(k_max=12))
    for policy, draft_s in ((cheap, 0.004), (costly, 0.2)):  # costly: one draft token is half a target step
        for _ in range(4):
            for accepted in range(12):  # each position accepts a little less often than the one before
                policy.record(12, accepted, draft_s * 12 / 4, 0.1)
    assert costly.draft_ratio > 10 * cheap.draft_ratio
    assert 0 < costly.best_length() < cheap.best_length()


def test_overlap_costs_follow_the_cost_model():
    """Overlap hides the draft when the pre-draft hits, but the pre-draft (k + 1 tokens) must fit in the
    verification: with drafts as costly as here it prefers a shorter block than sync would."""
    config = dict(k_max=8, draft_ratio=0.4, prior=0.95)  # every position 0.95 before evidence
    sync = AdaptiveDraftLength(AdaptiveConfig(**config))
    overlap = AdaptiveDraftLength(AdaptiveConfig(**config, overlap=True))
    for k in (1, 4, 8):
        hit = 0.95 ** (k + 1)
        verify = 1 + 0.05 * k
        assert overlap.step_cost(k) == pytest.approx(max(verify, 0.4 * (k + 1)) + (1 - hit) * 0.4 * k)
        assert sync.step_cost(k) == pytest.approx(verify + 0.4 * k)
    assert overlap.step_cost(2) < sync.step_cost(2)
    assert overlap.step_cost(8) > sync.step_cost(8)  # a long pre-draft outlasts verification and often misses
    assert overlap.best_length() == 2 < sync.best_length() == 6


def test_expected_tokens_matches_the_closed_form():
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=4, prior=0.5))
    assert policy.acceptance.first == 0.5
    assert policy.expected_tokens(0) == pytest.approx(1.0)
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_a_block_drafter_priced_per_pass_drafts_up_to_where_its_positions_stop_paying():
    """A pass costs the same for any k; later positions accept less (a parallel drafter's guesses), so the
    policy drafts up to the position whose expected gain no longer covers its verification row; priced per token
    the same pass looks cheap for k = 1 and dear for long blocks."""
    config = dict(k_max=8, verify_growth=0.1)
    per_pass = AdaptiveDraftLength(AdaptiveConfig(**config, per_pass=True))
    per_token = AdaptiveDraftLength(AdaptiveConfig(**config))
    for policy in (per_pass, per_token):
        for _ in range(40):  # positions accept 0.9, 0.6, 0.3, then nothing; a pass is 0.3 of a step
            for accepted in (3, 3, 2, 2, 1, 0, 3, 2, 1, 1):
                policy.record(4, accepted, 0.03, 0.1 + 0.01 * 4)
    assert per_pass.draft_ratio == pytest.approx(0.3)  # seconds per pass / plain step (0.14 s / 1.4)
    assert per_token.draft_ratio == pytest.approx(0.3 / 4)
    rates = per_pass.acceptance.rates(4)
    assert rates[0] > rates[1] > rates[2] and rates[3] < 0.05
    assert per_pass.best_length() == 3  # the fourth row costs 0.1 of a step for ~0 expected tokens
    assert per_pass.step_cost(3) == pytest.approx(per_pass.draft_ratio + 1 + per_pass.forward.growth() * 3)


def test_make_policy_picks_the_kind():
    assert isinstance(make_policy(False, 4, overlap=False), FixedDraftLength)
    adaptive = make_policy(True, 4, overlap=True)
    assert isinstance(adaptive, AdaptiveDraftLength) and adaptive.config.overlap and adaptive.config.k_max == 4
    assert not adaptive.config.per_pass and make_policy(True, 4, overlap=False, per_pass=True).config.per_pass


def test_adaptive_by_default_only_for_gguf_weights_and_the_cli_can_say_either():
    from dflash2.cli import build_parser
    from dflash2.decode.draft_length import default_adaptive_draft

    assert default_adaptive_draft("gguf") and not any(map(default_adaptive_draft, ("bf16", "int8", "int4")))
    parse = build_parser().parse_args
    assert parse(["generate", "hi"]).adaptive_draft is None  # the API decides by the weight format
    assert parse(["generate", "hi", "--adaptive-draft"]).adaptive_draft is True
    assert parse(["generate", "hi", "--no-adaptive-draft"]).adaptive_draft is False
    assert parse(["bench", "--no-adaptive-draft"]).adaptive_draft is False


def test_at_one_length_the_policy_varies_k_once_in_a_while_to_fit_the_verification_cost():
    """Every forward of the same size leaves the verification cost's growth unknown (the prior 0.05 rates a
    4-row verification at 1.15 plain steps where a 4-bit CPU kernel needs ~2): one step in probe_interval drafts
    one fewer, the fit then finds the true growth, and a pass that does not pay is switched off."""
    from dflash2.decode.draft_length import verification_cost_model

    shared = verification_cost_model()
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=3, per_pass=True, probe_interval=4), shared)
    lengths = []
    for step in range(40):
        k = policy.next_length(room=100)
        lengths.append(k)
        would_accept = [1, 1, 0, 2, 1][step % 5]  # position 0 accepts 0.8, position 1 after it 0.25, then none
        policy.record(k, min(would_accept, k), 0.024, 0.040 * (1 + 0.33 * k))  # a pass: 0.6 step; growth 0.33
    assert 2 in lengths[:8]  # an exploring step
    assert shared.fitted() and shared.growth() == pytest.approx(0.33)
    assert policy.best_length() == 0  # k = 1: 1.8 tokens for 0.6 + 1.33 steps; plain decoding wins
    again = AdaptiveDraftLength(AdaptiveConfig(k_max=3, per_pass=True), shared)  # the engine's next request
    assert again.forward.growth() == pytest.approx(shared.growth())


def test_verifications_are_priced_by_the_measured_time_of_their_size():
    """Two rows cost 1.5 one-row forwards on gguf (compute-bound), nine rows 3.5: with a first draft accepted half
    the time, one draft does not pay (1.5 tokens for 1.5 steps + the draft); the line through the sizes seen would
    say 1.3 steps and draft."""
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=1, prior=0.5, prior_weight=1000.0, draft_ratio=0.1))
    for tokens, ms in [(1, 30.0), (2, 45.0), (9, 105.0)] * 4:
        policy.forward.record(tokens, ms / 1000)
    assert policy.step_cost(1) == pytest.approx(0.1 + 1.5)
    assert policy.best_length() == 0
    c0, c1 = policy.forward.coefficients()
    assert (c0 + 2 * c1) / (c0 + c1) < 1.35  # what the line would have charged
