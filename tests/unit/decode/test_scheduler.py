import pytest

from dflash2.decode.cost_model import Acceptance, DraftCost, ForwardCost
from dflash2.decode.scheduler import RowDrafts, lower_hull, plan_draft_lengths, rate_of_plan


def geometric(alpha: float, k: int, pass_s: float = 0.0, token_s: float = 0.0) -> RowDrafts:
    return RowDrafts(k, [alpha ** (i + 1) for i in range(k)], pass_s, token_s)


def line(c0: float, c1: float):
    """A forward's seconds as one line: c0 + c1 * tokens."""
    return lambda tokens: c0 + c1 * tokens


def rate(rows: list[RowDrafts], plan: list[int], base: int, c0: float, c1: float, forward_s=None) -> float:
    """Expected committed tokens per second of a step with this plan (base rows, one token each without drafts)."""
    forward_s = forward_s or line(c0, c1)
    expected = base + sum(sum(row.reach[:k]) for row, k in zip(rows, plan))
    seconds = forward_s(base + sum(plan)) + sum(row.pass_s + row.token_s * k for row, k in zip(rows, plan) if k)
    return expected / seconds


def test_drafts_are_granted_when_tokens_are_nearly_free():
    rows = [geometric(0.8, 4)] * 2
    assert plan_draft_lengths(rows, base_tokens=2, base_expected=2.0, forward_s=line(1.0, 1e-4)) == [4, 4]


def test_speculation_is_switched_off_when_the_forward_is_compute_bound():
    assert plan_draft_lengths([geometric(0.3, 8)] * 8, base_tokens=8, base_expected=8.0,
                              forward_s=line(0.01, 1.0)) == [0] * 8


def test_better_accepted_requests_get_drafts_first():
    plan = plan_draft_lengths([geometric(0.9, 4), geometric(0.2, 4)], base_tokens=2, base_expected=2.0,
                              forward_s=line(1.0, 0.1))
    assert plan[0] > plan[1] and plan[0] >= 2


def test_every_granted_draft_raises_expected_tokens_per_second():
    rows, c0, c1 = [geometric(0.7, 5), geometric(0.5, 5), geometric(0.2, 5)], 1.0, 0.15
    plan = plan_draft_lengths(rows, base_tokens=3, base_expected=3.0, forward_s=line(c0, c1))
    best = rate(rows, plan, 3, c0, c1)
    for row in range(3):  # no single draft more or fewer does better
        for delta in (-1, 1):
            other = list(plan)
            other[row] += delta
            if 0 <= other[row] <= 5:
                assert rate(rows, other, 3, c0, c1) <= best + 1e-12


def test_a_drafting_pass_is_weighed_against_what_its_whole_block_gains():
    """A block drafter's pass costs the same for 1 or 4 drafts: one draft alone would not pay for it, four do;
    a pass that costs more than its block gains is not run at all (plain decoding for that row)."""
    c0, c1 = 0.1, 0.001
    cheap = [RowDrafts(4, [0.5, 0.4, 0.3, 0.2], pass_s=0.1)]
    assert plan_draft_lengths(cheap, base_tokens=1, base_expected=1.0, forward_s=line(c0, c1)) == [4]
    costly = [RowDrafts(4, [0.5, 0.4, 0.3, 0.2], pass_s=0.3)]
    assert plan_draft_lengths(costly, base_tokens=1, base_expected=1.0, forward_s=line(c0, c1)) == [0]
    assert rate(costly, [4], 1, c0, c1) < rate(costly, [0], 1, c0, c1)
    assert rate(cheap, [4], 1, c0, c1) > rate(cheap, [1], 1, c0, c1)


def test_with_many_rows_drafting_passes_lose_to_plain_batching():
    """Eight requests with a block drafter each: on a forward that costs little more per row, eight passes of
    a quarter of the forward's time outweigh what moderate acceptance gains, so the plan is plain batching; with
    prompt lookup (nearly free) drafting stays on."""
    c0, c1 = 0.1, 0.002
    pard = [RowDrafts(3, [0.6, 0.3, 0.1], pass_s=0.025)] * 8
    assert plan_draft_lengths(pard, base_tokens=8, base_expected=8.0, forward_s=line(c0, c1)) == [0] * 8
    lookup = [RowDrafts(3, [0.6, 0.3, 0.1], pass_s=0.0001)] * 8
    assert all(k > 0 for k in plan_draft_lengths(lookup, base_tokens=8, base_expected=8.0, forward_s=line(c0, c1)))


def test_the_plan_is_the_best_of_every_possible_plan_on_small_cases():
    import itertools

    c0, c1 = 0.1, 0.01
    rows = [RowDrafts(3, [0.9, 0.8, 0.7], pass_s=0.05), RowDrafts(3, [0.5, 0.2, 0.1], pass_s=0.02),
            RowDrafts(2, [0.6, 0.3], token_s=0.02)]
    plan = plan_draft_lengths(rows, base_tokens=3, base_expected=3.0, forward_s=line(c0, c1))
    best = max(rate(rows, list(p), 3, c0, c1) for p in itertools.product(range(4), range(4), range(3)))
    assert rate(rows, plan, 3, c0, c1) == pytest.approx(best, rel=0.02)


def test_the_plan_prices_each_forward_size_by_the_measured_curve():
    """One request on a CPU whose small forwards stream the weights: 1-3 tokens cost about one forward, more turn
    compute-bound. The line fitted through the sizes seen (1, 2, 3, 9 tokens) rates 3 tokens at 1.9 one-token
    forwards and refuses a pass that the measured curve (1.05) pays for; the plan is the best of all plans under
    the curve, and a free extension (a flat stretch of the curve) is granted."""
    cost = ForwardCost(prior=(1.0, 0.0))
    for tokens, seconds in [(1, 1.0), (2, 1.02), (3, 1.05), (9, 3.4)] * 4:
        cost.record(tokens, seconds)
    rows = [RowDrafts(8, [0.7, 0.45, 0.2, 0.1, 0.05, 0.02, 0.01, 0.0], pass_s=0.35)]
    assert plan_draft_lengths(rows, base_tokens=1, base_expected=1.0, forward_s=line(*cost.coefficients())) == [0]
    plan = plan_draft_lengths(rows, base_tokens=1, base_expected=1.0, forward_s=cost.seconds)
    assert plan == [2]
    best = max(rate(rows, [k], 1, 0, 0, cost.seconds) for k in range(9))
    assert rate(rows, plan, 1, 0, 0, cost.seconds) == pytest.approx(best)
    flat = [RowDrafts(2, [0.5, 0.1])]  # no drafting cost, and 2 -> 3 tokens cost nothing on a flat curve
    assert plan_draft_lengths(flat, base_tokens=1, base_expected=1.0, forward_s=lambda n: 1.0 if n <= 3 else n) == [2]


def test_rows_of_one_shared_network_pay_its_pass_together():
    """Eight requests whose drafts are one shared pass (the weights read once, then ~1 ms per id fed): no single
    row's drafts would pay for the whole pass, all eight together do. Greedy row by row would leave it off; the
    plan runs it, and it is the best of the plans that run it or not."""
    c0, c1 = 0.150, 0.001
    network = {"pard": lambda ids: 0.030 + 0.001 * ids}
    rows = [RowDrafts(3, [0.8, 0.5, 0.3], network="pard", reads=2.0)] * 8
    alone = [RowDrafts(3, [0.8, 0.5, 0.3], pass_s=0.030 + 0.001 * 5)]
    assert plan_draft_lengths(alone, base_tokens=8, base_expected=8.0, forward_s=line(c0, c1)) == [0]
    plan = plan_draft_lengths(rows, base_tokens=8, base_expected=8.0, forward_s=line(c0, c1), network_s=network)
    assert all(k > 0 for k in plan)
    off = rate_of_plan(rows, [0] * 8, 8, 8.0, line(c0, c1), network)
    assert rate_of_plan(rows, plan, 8, 8.0, line(c0, c1), network) > off
    assert off == pytest.approx(8.0 / 0.158)  # no row drafts: no pass is run


def test_the_plan_crosses_a_jump_in_the_forwards_cost_when_the_rows_past_it_pay():
    """AMX tiles: 1-16 rows cost one block of rows, 17-32 two (the 1.5B target, 8 requests: 132 vs 160 ms). One
    draft at a time, the 17th row costs the whole jump and is refused; filling the second block pays. The plan is
    the best of every plan that gives each row the same number of drafts, and below 16 rows nothing changes."""
    network = {"pard": lambda ids: 0.020 + 0.0006 * ids}
    rows = [RowDrafts(3, [0.8, 0.5, 0.3], network="pard", reads=1.6)] * 8

    def tiles(tokens: int) -> float:
        return 0.132 if tokens <= 16 else 0.160 if tokens <= 32 else 0.200

    plan = plan_draft_lengths(rows, base_tokens=8, base_expected=8.0, forward_s=tiles, network_s=network)
    assert sum(plan) == 24  # 32 rows: the second block filled
    uniform = {k: rate_of_plan(rows, [k] * 8, 8, 8.0, tiles, network) for k in range(4)}
    assert max(uniform, key=uniform.get) == 3 and uniform[3] > uniform[1]
    assert rate_of_plan(rows, plan, 8, 8.0, tiles, network) == pytest.approx(uniform[3])
    smooth = plan_draft_lengths(rows, base_tokens=8, base_expected=8.0, forward_s=line(0.100, 0.004), network_s=network)
    assert smooth == plan_draft_lengths(rows, base_tokens=8, base_expected=8.0, forward_s=lower_hull(
        line(0.100, 0.004), 8, 32), network_s=network)  # a convex cost is its own hull


def test_the_lower_hull_spreads_a_jump_over_the_sizes_past_it():
    def tiles(tokens: int) -> float:
        return 1.0 if tokens <= 16 else 2.0

    hull = lower_hull(tiles, 8, 32)
    assert hull(8) == tiles(8) and hull(32) == tiles(32) and hull(40) == tiles(40)  # its ends, and outside it
    assert hull(16) == 1.0 and hull(24) == pytest.approx(1.5) and all(hull(n) <= tiles(n) for n in range(8, 33))
    steps = [hull(n + 1) - hull(n) for n in range(8, 32)]
    assert all(b >= a - 1e-12 for a, b in zip(steps, steps[1:]))  # convex: no jump left


def test_a_shared_pass_that_does_not_pay_is_left_out():
    network = {"pard": lambda ids: 0.5 + 0.001 * ids}  # a pass that costs three forwards
    rows = [RowDrafts(3, [0.6, 0.3, 0.1], network="pard", reads=1.0)] * 4 + [RowDrafts(2, [0.9, 0.8])]  # + lookup
    plan = plan_draft_lengths(rows, base_tokens=5, base_expected=5.0, forward_s=line(0.15, 0.001), network_s=network)
    assert plan[:4] == [0] * 4 and plan[4] == 2


def test_a_rows_reads_are_priced_by_the_ids_it_adds_to_the_shared_pass():
    """Two rows that differ only in what they must read first (a prompt's share): the cheaper one drafts first."""
    network = {"pard": lambda ids: 0.01 + 0.004 * ids}
    rows = [RowDrafts(2, [0.7, 0.4], network="pard", reads=40.0), RowDrafts(2, [0.7, 0.4], network="pard", reads=1.0)]
    plan = plan_draft_lengths(rows, base_tokens=2, base_expected=2.0, forward_s=line(0.1, 0.005), network_s=network)
    assert plan[1] == 2 and plan[0] == 0


def test_a_new_request_leans_on_its_drafters_pooled_acceptance():
    pool = Acceptance(decay=0.98)
    first = Acceptance(pool=pool)
    for _ in range(30):
        first.update(3, 2)  # positions 0, 1 accepted, position 2 rejected
    fresh = Acceptance(pool=pool)  # no evidence of its own yet: the pool's rates, not the 0.5 prior
    assert fresh.rates(3) == pytest.approx(pool.rates(3))
    assert fresh.rates(3)[0] > 0.9 and fresh.rates(3)[2] < 0.1
    for _ in range(10):
        fresh.update(1, 0)  # its own first drafts rejected: its evidence outweighs the pool
    assert fresh.first < 0.2 and pool.first > 0.6
    assert Acceptance().rates(2) == pytest.approx([0.5, 0.5])  # no pool: the prior, as before


def test_acceptance_counts_each_position_up_to_the_first_rejection():
    acceptance = Acceptance(prior=0.5, prior_weight=1e-9, decay=1.0)
    acceptance.update(4, 4)  # positions 0-3 tested and accepted
    acceptance.update(4, 1)  # position 0 accepted, position 1 rejected
    acceptance.update(0, 0)  # nothing drafted: no evidence
    assert acceptance.rates(4) == pytest.approx([1.0, 0.5, 1.0, 1.0])
    assert acceptance.reach(4) == pytest.approx([1.0, 0.5, 0.5, 0.5])
    assert acceptance.expected_tokens(2) == pytest.approx(2.5)


def test_an_untested_position_leans_on_the_one_before_it_until_evidence_outweighs_it():
    acceptance = Acceptance(prior=0.75, prior_weight=2.0, decay=1.0)  # no decay: the prior keeps its weight
    assert acceptance.rates(3) == pytest.approx([0.75] * 3)
    for _ in range(8):
        acceptance.update(1, 0)  # the first draft always rejected; later positions never tested
    assert acceptance.rates(3) == pytest.approx([(0 + 2 * 0.75) / (8 + 2)] * 3)
    for _ in range(20):
        acceptance.update(2, 1)  # position 0 accepted, position 1 rejected
    rates = acceptance.rates(3)
    assert rates[0] > 0.6 and rates[1] < 0.1 and rates[2] == pytest.approx(rates[1])
    decaying = Acceptance(prior=0.75, prior_weight=2.0, decay=0.9)
    for _ in range(40):
        decaying.update(4, 0)
    assert decaying.first < 0.01  # the prior's pseudo-counts decayed with the evidence


def test_draft_cost_prices_passes_and_what_a_resuming_drafter_reads():
    """seconds = pass_s * passes + read_s * tokens: a block drafter runs one pass for k drafts, a draft model k; the
    ids missed while a row did not draft are read first (a catch-up that costs more than a usual pass)."""
    block, model = DraftCost(per_pass=True), DraftCost(per_pass=False)
    assert block.seconds(3, 0) == 0.0  # nothing measured yet
    for unread in (1, 1, 2, 40, 1, 3, 1, 90, 1, 2):
        for k in (1, 3):
            block.record(k, unread, 0.020 + 0.002 * (unread + k))
            model.record(k, unread, 0.010 * k + 0.002 * (unread + k))
    assert block.coefficients() == pytest.approx((0.020, 0.002))
    assert model.coefficients() == pytest.approx((0.010, 0.002))
    assert block.seconds(3, 50) == pytest.approx(0.020 + 0.002 * 53)
    assert model.seconds(3, 0) == pytest.approx(0.030 + 0.002 * 3)
    few = DraftCost(per_pass=True)
    for unread, seconds in ((150, 0.30), (100, 0.20)):  # two catch-ups (prompts read at the first draft)
        few.record(2, unread, seconds)
    assert few.coefficients() == (0.0, pytest.approx(0.002, rel=0.02))  # no fit yet: all per token fits them
    few.record(2, 0, 0.004)
    assert few.seconds(3, 0) == pytest.approx(0.006, rel=0.05)  # a usual pass is priced as cheap, not as 0.25 s
    few.record(0, 5, 9.0)  # nothing drafted: nothing learnt
    assert len(few.samples) == 3
    model = DraftCost(per_pass=False)
    model.record(2, 0, 0.02)
    assert model.coefficients() == (pytest.approx(0.01), 0.0)  # one call fits both exactly: its own unit wins


def test_cost_model_fits_a_line_and_keeps_the_prior_without_spread():
    model = ForwardCost(window=29, prior=(9.0, 9.0))
    assert model.coefficients() == (9.0, 9.0)  # nothing seen: the prior
    for _ in range(10):
        model.record(4, 1.0)
    # every step had the same size: no fit, the prior's shape through the measured time (0.2 + 0.2 * 4 = 1.0)
    assert not model.fitted() and model.coefficients() == pytest.approx((0.2, 0.2))
    for tokens in range(1, 30):  # the window now holds only these
        model.record(tokens, 0.02 + 0.001 * tokens)
    assert model.coefficients() == pytest.approx((0.02, 0.001))


def test_a_fit_that_is_not_positive_falls_back_to_the_prior_scaled_to_the_measured_forwards():
    model = ForwardCost(prior=(9.0, 1.0))
    for tokens, seconds in [(1, 0.30), (2, 0.20), (3, 0.10)] * 3:  # time falls with size: c1 < 0, no use
        model.record(tokens, seconds)
    assert model.fitted() and model.coefficients() == pytest.approx((9 * 0.2 / 11, 0.2 / 11))  # 9 : 1 via (2, 0.2)


def test_a_forwards_cost_follows_the_mean_time_of_each_size_not_one_line():
    """On 4-bit blocks one row streams the weights and two rows are compute-bound (Zen 4, gguf 1.5B: 1, 4, 9 rows
    cost 31, 69, 108 ms): the line through them underrates the small sizes a request drafts."""
    model = ForwardCost()
    for tokens, ms in [(1, 31.0), (4, 69.0), (9, 108.0)] * 3:
        model.record(tokens, ms / 1000)
    c0, c1 = model.coefficients()
    assert (c0 + 2 * c1) / (c0 + c1) < 1.3  # the line: 2 rows cost < 1.3 one-row forwards
    assert model.seconds(1) == pytest.approx(0.031) and model.seconds(4) == pytest.approx(0.069)
    assert model.seconds(2) == pytest.approx(0.031 + (0.069 - 0.031) / 3)  # between two sizes seen: linear
    assert model.seconds(11) == pytest.approx(0.108 + 2 * c1)  # beyond them: the line's slope
    assert model.relative(4) == pytest.approx(69 / 31) and model.relative(2) > 1.4


def test_a_larger_size_measured_faster_is_pooled_with_the_one_before_it():
    model = ForwardCost()
    for tokens, seconds in [(2, 0.05), (3, 0.07), (3, 0.07), (4, 0.06), (4, 0.06)]:  # 4 faster than 3: noise
        model.record(tokens, seconds)
    assert model.seconds(3) == model.seconds(4) == pytest.approx(0.065)  # never falls with size
    assert model.seconds(2) == pytest.approx(0.05)
    assert 0.025 <= model.seconds(1) < 0.05  # below the sizes seen: at least the share of the smallest one


def test_a_prompt_read_before_the_first_draft_is_spread_over_the_requests_remaining_steps():
    """A request whose drafter has not read its 300-id prompt yet: one step's price of that read (~0.3 s) would never
    pay back, so the row would never draft; it is charged its share per remaining step. A request about to finish
    bears nearly all of it."""
    from types import SimpleNamespace

    from dflash2.decode.batch_drafting import BatchDrafting

    class Network:  # stands in for a pard drafter: its pass shares one network (pure pricing logic under test)
        model = object()

        def runs_a_pass(self, sequence, k):
            return True

        def unread(self, sequence):
            return 300

        def shared_pass(self, sequence, k):
            return self, k

        def drafted_by_shared_pass(self):
            raise AssertionError("pricing drafts nothing")

    def request(generated: int) -> SimpleNamespace:
        acceptance = Acceptance(prior=0.5, prior_weight=1e-9, decay=1.0)
        acceptance.update(3, 0)  # expected tokens per step: 1.0
        return SimpleNamespace(drafter=Network(), sequence=[0] * 301, acceptance=acceptance, max_slots=10_000,
                               request=SimpleNamespace(max_new_tokens=101, drafter="pard"),
                               output=SimpleNamespace(generated=[0] * generated))

    drafting = BatchDrafting(adaptive=True, forward_cost=ForwardCost(), guard=None)
    early, late = drafting._row_drafts(request(1), 3), drafting._row_drafts(request(99), 3)
    assert early.network is not None and early.reads == pytest.approx(1 + 299 / 100)
    assert late.reads == pytest.approx(1 + 299 / 2)
