"""Draft-length policies: the adaptive one follows acceptance and costs, switches speculation off and probes."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.cost_model import Confidence, ContextCosts, ForwardCost, nodes_tested
from dflash2.decode.draft_length import (ONE_ROW_TIMED_FROM, AdaptiveConfig, AdaptiveDraftLength, FixedDraftLength,
                                        keep_nodes, make_policy)
from dflash2.drafters.base import Draft


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


def test_a_plain_step_times_one_row_where_every_verification_seen_had_more():
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=4))
    policy.at_context(8000)
    feed(policy, 10, accepted=4, drafted=4)
    assert policy.next_length(room=100) == 0  # a plain step, the unit of every other cost, is only extrapolated here
    policy.record(0, 0, 0.0, 0.05)
    assert policy.forward.seconds(1) == pytest.approx(0.05)
    assert policy.next_length(room=100) == 4
    policy.at_context(3000)  # another long context, nothing verified there yet: speculation first
    assert policy.next_length(room=100) == 4
    feed(policy, 1, accepted=4, drafted=4)
    assert policy.next_length(room=100) == 0
    policy.at_context(ONE_ROW_TIMED_FROM - 1)  # a short one: its one-row cost extrapolated
    feed(policy, 3, accepted=4, drafted=4)
    assert policy.next_length(room=100) == 4


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
    assert shared.at(0).fitted() and shared.at(0).growth() == pytest.approx(0.33)
    assert policy.best_length() == 0  # k = 1: 1.8 tokens for 0.6 + 1.33 steps; plain decoding wins
    again = AdaptiveDraftLength(AdaptiveConfig(k_max=3, per_pass=True), shared)  # the engine's next request
    assert again.forward.growth() == pytest.approx(shared.at(0).growth())


def test_verifications_are_priced_by_forwards_at_their_context_length():
    """Rows cost more after a long context (each attends to all of it): an engine's shared costs keep one fit per
    context bucket, a request's trim keeps fewer nodes where rows cost more, and a bucket seen for the first time
    starts from the nearest bucket's line instead of the prior."""
    from dflash2.decode.cost_model import context_bucket
    from dflash2.decode.draft_length import verification_cost_model

    assert [context_bucket(n) for n in (0, 1023, 1024, 2047, 2048, 8000, 16384)] == [0, 0, 1, 1, 2, 3, 5]
    shared = verification_cost_model()
    policy = FixedDraftLength(4, shared, per_pass=True)
    for context, growth in ((200, 0.05), (8000, 0.6)):  # a plain step 30 ms; each further row 5% or 60% of it
        policy.at_context(context)
        for step in range(24):
            rows = 1 + step % 5
            policy.record(rows - 1, 0, 0.0, 0.030 * (1 + growth * (rows - 1)), rows)
    assert shared.at(100).relative(5) == pytest.approx(1.2)
    assert shared.at(7000).relative(5) == pytest.approx(3.4)
    draft = Draft(tokens=torch.arange(4), q_draft=None, confidence=torch.tensor([0.9, 0.8, 0.7, 0.6]))
    policy.at_context(300)
    short = len(policy.trim(draft).tokens)
    policy.at_context(7500)
    long = len(policy.trim(draft).tokens)
    assert short == 4 and long < short
    fresh = shared.at(3000)  # 2-4K: never seen; it starts from the 4-8K line, its nearest
    assert fresh.coefficients() == pytest.approx(shared.at(8000).coefficients())
    assert ContextCosts(single=shared.at(0)).at(9000) is shared.at(0)


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


# ---- trimming a draft by the drafter's confidence ---------------------------------------------------------------

def steep_policy(k_max: int = 4) -> AdaptiveDraftLength:
    """An adaptive policy whose verification of n rows costs (1 + n) / 2 one-row forwards (the prior line, no
    forward recorded) and whose pass costs 0.3 of one."""
    return AdaptiveDraftLength(AdaptiveConfig(k_max=k_max, per_pass=True, draft_ratio=0.3),
                               ForwardCost(prior=(0.5, 0.5)))


def chain(confidence: list[float]) -> Draft:
    return Draft(tokens=torch.arange(10, 10 + len(confidence)), q_draft=None,
                 confidence=torch.tensor(confidence))


def test_a_chain_is_cut_where_its_drafts_stop_paying_for_their_rows():
    """Rates from the bins' priors (0.95 for p 0.99, 0.15 for p 0.1): 2 drafts give 2.85 tokens for 0.3 + 1.5 steps,
    the third adds 0.14 tokens for half a step."""
    kept = steep_policy().trim(chain([0.99, 0.99, 0.1, 0.99]))
    assert kept.tokens.tolist() == [10, 11] and kept.parents is None
    assert kept.confidence.tolist() == pytest.approx([0.99, 0.99])


def test_where_rows_cost_nothing_more_the_whole_draft_is_verified():
    flat = AdaptiveDraftLength(AdaptiveConfig(k_max=4, per_pass=True), ForwardCost(prior=(1.0, 0.0)))
    draft = chain([0.99, 0.5, 0.1, 0.05])
    assert flat.trim(draft) is draft


def test_the_likeliest_draft_stays_however_unlikely():
    kept = steep_policy().trim(chain([0.05, 0.05, 0.05]))
    assert kept.tokens.tolist() == [10]


def test_drafts_without_confidence_and_policies_that_do_not_trim_keep_them_whole():
    draft = Draft(tokens=torch.arange(4), q_draft=None)
    assert steep_policy().trim(draft) is draft
    confident = chain([0.99, 0.1, 0.1])
    assert FixedDraftLength(3, ForwardCost(prior=(0.5, 0.5)), per_pass=True, trim=False).trim(confident) is confident
    overlapped = AdaptiveDraftLength(AdaptiveConfig(k_max=3, overlap=True), ForwardCost(prior=(0.5, 0.5)))
    assert overlapped.trim(confident) is confident
    assert not make_policy(False, 3, overlap=True).trims and not make_policy(True, 3, overlap=True).trims


def test_a_fixed_length_trims_like_the_adaptive_policy_and_learns_the_costs():
    fixed = FixedDraftLength(4, ForwardCost(prior=(0.5, 0.5)), per_pass=True)
    assert fixed.trim(chain([0.99, 0.99, 0.1, 0.99])).tokens.tolist() == [10, 11]
    assert fixed.next_length(room=10) == 4  # the pass's size stays fixed
    for _ in range(4):  # a plain step of 30 ms, a pass of 15 ms and 5 rows of 45 ms
        fixed.record(0, 0, 0.0, 0.030)
        fixed.record(4, 2, 0.015, 0.045)
    assert fixed.forward.relative(5) == pytest.approx(1.5)
    assert 0.3 < fixed.draft_ratio < 0.5  # moving from the prior 0.3 to the measured 0.5


def test_a_tree_keeps_its_likeliest_nodes_with_their_parents_renumbered():
    """Nodes: a chain 0-1-2 and a branch 3-4 under the pending token. Reach: 0.95, 0.90, 0.14 (chain) and 0.45,
    0.43 (branch): the best four are 0, 1, 3, 4."""
    draft = Draft(tokens=torch.tensor([20, 21, 22, 30, 31]), q_draft=None, parents=[-1, 0, 1, -1, 3],
                  confidence=torch.tensor([0.99, 0.99, 0.1, 0.45, 0.99]))
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=4, per_pass=True), ForwardCost(prior=(0.8, 0.2)))
    kept = policy.trim(draft)
    assert kept.tokens.tolist() == [20, 21, 30, 31]
    assert kept.parents == [-1, 0, -1, 2]
    assert kept.confidence.tolist() == pytest.approx([0.99, 0.99, 0.45, 0.99])


def test_keep_nodes_renumbers_parents_and_refuses_a_chain_with_a_gap():
    draft = Draft(tokens=torch.tensor([5, 6, 7, 8]), q_draft=torch.eye(4), parents=[-1, 0, 0, 2],
                  confidence=torch.tensor([0.9, 0.2, 0.8, 0.7]))
    kept = keep_nodes(draft, [0, 2, 3])
    assert kept.tokens.tolist() == [5, 7, 8] and kept.parents == [-1, 0, 1]
    assert torch.equal(kept.q_draft, torch.eye(4)[[0, 2, 3]])
    with pytest.raises(ValueError, match="prefix"):
        keep_nodes(chain([0.9, 0.9, 0.9]), [0, 2])


def test_tested_nodes_are_the_children_of_the_accepted_path():
    # a chain of 4, two accepted: drafts 0, 1 hit, 2 missed, 3 never tested
    assert nodes_tested(None, 4, [0, 1, 2]) == [(0, True), (1, True), (2, False)]
    # a tree: root children 0 and 3; 3 accepted; its children 4 (missed) and 5 (accepted), then 5 has none
    parents = [-1, 0, 1, -1, 3, 3]
    assert nodes_tested(parents, 6, [0, 4, 6]) == [(0, False), (3, True), (4, False), (5, True)]
    assert nodes_tested(parents, 6, [0]) == [(0, False), (3, False)]


def test_the_confidence_bins_learn_what_was_accepted():
    policy = steep_policy()
    draft = chain([0.95, 0.95, 0.95])
    assert policy.confidence.rate(0.95) == pytest.approx(0.95)
    for _ in range(40):  # an overconfident drafter: its first draft always rejected
        policy.calibrate(draft, kept_positions=[0])
    assert policy.confidence.rate(0.95) < 0.1
    assert policy.confidence.rate(0.55) == pytest.approx(0.55)  # other bins untouched
    assert policy.trim(chain([0.95, 0.95, 0.95])).tokens.tolist() == [10]
    with pytest.raises(ValueError):
        Confidence(bins=0)


def test_a_tree_verification_is_priced_by_its_rows_not_its_depth():
    """A tree of 8 nodes and depth 3 verifies 9 rows: its time goes to the cost of 9 rows."""
    policy = AdaptiveDraftLength(AdaptiveConfig(k_max=4, per_pass=True))
    for _ in range(4):
        policy.record(0, 0, 0.0, 0.030)  # plain steps: 1 row
        policy.record(3, 1, 0.010, 0.060, rows=9)
    assert policy.forward.seconds(9) == pytest.approx(0.060)
    assert policy.forward.relative(9) == pytest.approx(2.0)
    assert len(policy.acceptance.tested) == 2  # depth 3, one accepted: drafts 1 and 2 were tested


def test_a_seeded_sampled_request_keeps_its_drafts_whole_at_a_fixed_length():
    """Its random draws must not depend on timings: no trimming, no adaptive length. Unseeded or greedy: as asked."""
    from dflash2.verify.sampling import GREEDY, SamplingParams

    seeded = make_policy(True, 4, overlap=False, per_pass=True, params=SamplingParams(temperature=0.8, seed=1))
    assert isinstance(seeded, FixedDraftLength) and not seeded.trims and seeded.k == 4
    unseeded = make_policy(True, 4, overlap=False, per_pass=True, params=SamplingParams(temperature=0.8))
    assert isinstance(unseeded, AdaptiveDraftLength) and unseeded.trims
    assert make_policy(False, 4, overlap=False, params=GREEDY).trims
