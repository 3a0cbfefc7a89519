"""The one cost model of the decode loops, and the one acceptance estimator.

:class:`Acceptance`: a request's draft acceptance rate per draft position, from decayed counts.
:class:`DraftCost`: seconds of drafting, per pass (block drafters) or per draft token (draft models).
:class:`ForwardCost`: a target forward over N tokens costs ``c0 + c1 * N`` seconds (c0: reading the weights once,
c1: compute per token), fitted online from measured forwards. The batch planner (``decode/scheduler.py``) prices
the drafts of a ragged step with the line; the adaptive draft length (``decode/draft_length.py``) prices a
verification of k drafts as ``relative(1 + k)`` plain steps, from the mean time of each size seen (``seconds``).
:class:`ContextCosts`: one :class:`ForwardCost` per context length bucket, since every further row attends to the
whole context (at 8K cached positions on gguf, 4 rows cost 2.2 one-row forwards against 1.5 at 200).
:class:`StepCosts`: one speculative step, sync vs overlapped: what overlap can gain, from measured times.
:class:`Confidence`: how often a draft is accepted given the drafter's own probability of it, counted per bin of that
probability (the adaptive draft length trims each draft by it).

Per target pass (one step), with times measured when each side runs alone:
- sync:    ``T_sync = D + V``: draft the block (D), then verify it (V); each side idles while the other works.
- overlap: ``T_overlap = max(s_V * V, s_D * A) + (1 - h) * D``. While the target verifies, the drafter pre-drafts
  ahead (A: the bonus guess + the next block, about D * (k + 1) / k); on a hit (rate h) the next verification
  starts at once, on a miss the target waits for a fresh draft (D). ``s_V``, ``s_D`` >= 1 are the slowdowns of
  each side while both run: on a 2-core CPU they share cores and memory bandwidth (measured about 1.3 - 2),
  on a GPU with the drafter on its own stream they are close to 1 (a batch-1 target leaves most SMs idle).
Tokens per pass (tau) are the same in both pipelines, so the speedup is ``T_sync / T_overlap``.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np


class Acceptance:
    """A request's draft acceptance by position: ``rate(i)`` is the probability that draft i (0-based) is accepted
    given that every draft before it was. Block drafters fill their positions from less and less context (a
    parallel drafter's later positions are guesses), so one rate for all positions overrates long blocks.

    Each position keeps decayed counts of the drafts tested there (reached: the earlier ones were all accepted)
    and of those accepted; the counts decay only when the position is tested, so a rarely reached position keeps
    its evidence. A position leans on the one before it (position 0 on ``prior``) with ``prior_weight``
    pseudo-counts that decay with its own observations: an untested position is rated like the last tested one,
    and evidence soon outweighs the assumption. Given a ``pool`` (the acceptance of every request of the same
    drafter, updated with this one's), each position leans on the pool's rate there instead: a new request starts
    from what its drafter has been accepting, not from ``prior``."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = 0.9,
                 pool: Acceptance | None = None) -> None:
        if not 0.0 < prior < 1.0 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need 0 < prior < 1, prior_weight > 0, 0 < decay <= 1; got {prior}, {prior_weight}, "
                             f"{decay}")
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.pool = pool
        self.accepted: list[float] = []  # per position: decayed count of accepted drafts
        self.tested: list[float] = []  # per position: decayed count of drafts tested
        self.weight: list[float] = []  # per position: decayed pseudo-counts of the previous position's rate

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """One verification: drafts 0..num_accepted-1 accepted, draft num_accepted (if drafted) rejected."""
        tested = min(num_drafted, num_accepted + 1)
        while len(self.tested) < tested:
            self.accepted.append(0.0)
            self.tested.append(0.0)
            self.weight.append(self.prior_weight)
        for i in range(tested):
            self.accepted[i] = self.decay * self.accepted[i] + (i < num_accepted)
            self.tested[i] = self.decay * self.tested[i] + 1.0
            self.weight[i] *= self.decay
        if self.pool is not None:
            self.pool.update(num_drafted, num_accepted)

    def rates(self, n: int) -> list[float]:
        """rate(i) for positions 0..n-1."""
        pooled = self.pool.rates(n) if self.pool is not None else None
        out, previous = [], self.prior
        for i in range(n):
            lean = previous if pooled is None else pooled[i]
            previous = lean
            if i < len(self.tested):
                accepted, tested, weight = self.accepted[i], self.tested[i], self.weight[i]
                previous = (accepted + weight * lean) / (tested + weight)
            out.append(previous)
        return out

    def reach(self, n: int) -> list[float]:
        """For positions 0..n-1: the probability that the draft there is accepted (all before it were too)."""
        out, product = [], 1.0
        for rate in self.rates(n):
            product *= rate
            out.append(product)
        return out

    def expected_tokens(self, k: int) -> float:
        """Tokens one verification of k drafts commits on average: the accepted drafts + the target's own token."""
        return 1.0 + sum(self.reach(k))

    @property
    def first(self) -> float:
        """rate(0): how often the first draft is accepted."""
        return self.rates(1)[0]


class DraftCost:
    """Seconds of one drafting call = ``pass_s * passes + read_s * tokens``: ``passes`` forwards (1 for a block
    drafter whatever k, k for a draft model), ``tokens`` fed in all (the ids the drafter had not read yet + the k
    drafted positions). A drafter that skipped steps first reads what it missed, so resuming costs more than a
    usual pass; the two terms price both. Least squares over the last ``window`` calls; until the calls vary enough
    for a fit (or when it is not positive), the better of the two one-term fits (all per pass, or all per token
    fed; a tie goes to the drafter's own unit of cost)."""

    def __init__(self, per_pass: bool, window: int = 64) -> None:
        self.per_pass = per_pass
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)  # (passes, tokens, seconds)

    def record(self, num_drafted: int, unread: int, seconds: float) -> None:
        if num_drafted > 0:
            self.samples.append((self.passes(num_drafted), unread + num_drafted, seconds))

    def passes(self, num_drafted: int) -> int:
        return 1 if self.per_pass else num_drafted

    def coefficients(self) -> tuple[float, float]:
        """(pass_s, read_s); (0, 0) before any call was measured."""
        if not self.samples:
            return 0.0, 0.0
        data = np.array(self.samples, dtype=np.float64)  # [n, 3]
        features, seconds = data[:, :2], data[:, 2]
        if len(self.samples) >= 8:
            (pass_s, read_s), *_ = np.linalg.lstsq(features, seconds, rcond=None)
            if pass_s > 0 and read_s > 0:
                return float(pass_s), float(read_s)
        fits = []
        for column in (0, 1):  # seconds = c * passes, or seconds = c * tokens
            x = features[:, column]
            c = float(x @ seconds / (x @ x))
            preferred = column == (1 if self.per_pass else 0)
            fits.append((float(((seconds - c * x) ** 2).sum()), not preferred, column, c))
        _, _, column, c = min(fits)
        return (c, 0.0) if column == 0 else (0.0, c)

    def seconds(self, num_drafted: int, unread: int) -> float:
        """Predicted seconds of drafting ``num_drafted`` tokens with ``unread`` ids to read first (0 for 0 drafts)."""
        if num_drafted <= 0:
            return 0.0
        pass_s, read_s = self.coefficients()
        return pass_s * self.passes(num_drafted) + read_s * (unread + num_drafted)


class Confidence:
    """P(a draft node is accepted | its parent was, the drafter gave its token probability p), from counts per
    bin of p. Each bin starts from p itself (the bin's middle) with ``prior_weight`` pseudo-counts: a drafter's
    own probability of its argmax is close to this rate already (the PARD drafter on the 1.5B target, greedy:
    0.95-0.97 accepted at p >= 0.8, 0.25-0.36 at p 0.2-0.4; docs/pard.md), and the counts correct a drafter
    whose probabilities are over- or underconfident. Counts decay by ``decay`` per update of their bin."""

    def __init__(self, bins: int = 10, prior_weight: float = 2.0, decay: float = 0.995) -> None:
        if bins < 1 or prior_weight <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need bins >= 1, prior_weight > 0, 0 < decay <= 1; got {bins}, {prior_weight}, {decay}")
        self.bins, self.decay = bins, decay
        self.accepted = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.tested = [prior_weight] * bins

    def _bin(self, p: float) -> int:
        return min(max(int(p * self.bins), 0), self.bins - 1)

    def rate(self, p: float) -> float:
        b = self._bin(p)
        return self.accepted[b] / self.tested[b]

    def update(self, outcomes: list[tuple[float, bool]]) -> None:
        """``outcomes``: (the drafter's probability, accepted) of each node the verification tested (a node is
        tested where its parent was accepted)."""
        for p, hit in outcomes:
            b = self._bin(p)
            self.accepted[b] = self.decay * self.accepted[b] + hit
            self.tested[b] = self.decay * self.tested[b] + 1.0


def nodes_tested(parents: list[int] | None, num_nodes: int, kept_positions: list[int]) -> list[tuple[int, bool]]:
    """(node, accepted) for each node of a draft that its verification tested: the children of the pending token,
    then those of each accepted node (a chain: its accepted drafts and the first rejected one). ``kept_positions``:
    the verification's kept inputs (0 = the pending token, node i = input i + 1)."""
    accepted = {position - 1 for position in kept_positions[1:]}
    parents = list(range(-1, num_nodes - 1)) if parents is None else parents
    out: list[tuple[int, bool]] = []
    current = -1
    while True:
        children = [node for node in range(num_nodes) if parents[node] == current]
        out.extend((node, node in accepted) for node in children)
        current = next((node for node in children if node in accepted), None)
        if current is None:
            return out


class ForwardCost:
    """Least-squares fit of forward seconds = c0 + c1 * tokens over the last ``window`` forwards."""

    def __init__(self, window: int = 128, prior: tuple[float, float] = (1.0, 1.0 / 32)) -> None:
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.prior = prior  # (c0, c1) until the forwards seen vary enough in size for a fit
        self._memo: dict[str, object] = {}  # the line and the curve of the samples as they are (a policy asks often)

    def record(self, num_tokens: int, seconds: float) -> None:
        self.samples.append((num_tokens, seconds))
        self._memo.clear()

    def fitted(self) -> bool:
        """Whether the forwards seen allow a fit: at least 8, of three sizes or more, or of two sizes seen twice each
        (with one size the split between c0 and c1 is unknown)."""
        if len(self.samples) < 8:
            return False
        sizes = Counter(tokens for tokens, _ in self.samples)
        return len(sizes) >= 3 or sum(count >= 2 for count in sizes.values()) >= 2

    def coefficients(self) -> tuple[float, float]:
        """(c0, c1): the least-squares line when :meth:`fitted` and positive; otherwise the prior's shape (c1 / c0)
        scaled to pass through the mean of the forwards seen (their time is known, only the split is not); the
        prior itself when nothing was seen."""
        if "line" not in self._memo:
            self._memo["line"] = self._line()
        return self._memo["line"]

    def _line(self) -> tuple[float, float]:
        if not self.samples:
            return self.prior
        tokens, seconds = np.array(self.samples, dtype=np.float64).T
        if self.fitted():
            c1, c0 = np.polyfit(tokens, seconds, 1)
            if c0 > 0 and c1 > 0:
                return float(c0), float(c1)
        c0, c1 = self.prior  # no fit, or not a positive one: the prior's shape through the measured mean
        scale = seconds.mean() / (c0 + c1 * tokens.mean())
        return float(c0 * scale), float(c1 * scale)

    def growth(self) -> float:
        """Extra cost of one more token over a one-token forward, relative to it: c1 / (c0 + c1)."""
        c0, c1 = self.coefficients()
        return c1 / (c0 + c1)

    def seconds(self, num_tokens: int) -> float:
        """Predicted seconds of a forward over ``num_tokens``: through the mean time of each size seen (made
        non-decreasing in size), linear between them, beyond them the nearest one plus the line's slope (below them
        at least the share of the smallest size's time proportional to its tokens). A CPU's
        cost is not one line: on 4-bit blocks one row streams the weights while two rows are compute-bound (Zen 4,
        gguf 1.5B: 1, 2, 3, 4, 9 rows cost 1, 1.5, 2.0, 2.2, 3.5 one-row forwards), so the line fitted over the
        sizes a request uses underrates the small ones."""
        c0, c1 = self.coefficients()
        if "curve" not in self._memo:
            self._memo["curve"] = self._curve()
        curve = self._memo["curve"]
        if not curve:
            return c0 + c1 * num_tokens
        sizes = [size for size, _ in curve]
        i = bisect.bisect_left(sizes, num_tokens)
        if i < len(curve) and sizes[i] == num_tokens:
            return curve[i][1]
        if 0 < i < len(curve):  # between two sizes seen
            (lo, t_lo), (hi, t_hi) = curve[i - 1], curve[i]
            return t_lo + (t_hi - t_lo) * (num_tokens - lo) / (hi - lo)
        if i == 0:  # below the sizes seen: a forward's time grows more slowly than its size (c0 > 0)
            size, t = curve[0]
            return max(t - c1 * (size - num_tokens), t * num_tokens / size)
        size, t = curve[-1]
        return t + c1 * (num_tokens - size)

    def relative(self, num_tokens: int) -> float:
        """A forward over ``num_tokens`` in units of a one-token forward."""
        return self.seconds(num_tokens) / self.seconds(1)

    def _curve(self) -> list[tuple[int, float]]:
        """(size, mean seconds) of each size seen, ascending, pooled where a larger size came out faster (noise)
        so that the times never fall with size (pool-adjacent-violators, weighted by the number of forwards)."""
        totals: dict[int, list[float]] = {}
        for tokens, seconds in self.samples:
            total = totals.setdefault(tokens, [0.0, 0.0])
            total[0] += seconds
            total[1] += 1.0
        blocks: list[list] = []  # [sizes, seconds sum, count]
        for size in sorted(totals):
            blocks.append([[size], *totals[size]])
            while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
                sizes, total, count = blocks.pop()
                blocks[-1][0] += sizes
                blocks[-1][1] += total
                blocks[-1][2] += count
        return [(size, total / count) for sizes, total, count in blocks for size in sizes]


CONTEXT_FLOOR = 1024  # cached positions below which attention is a small share of a forward: one bucket


def context_bucket(context: int) -> int:
    """The bucket of ``context`` cached positions: 0 below :data:`CONTEXT_FLOOR`, then one per doubling (1024-2047:
    1, 2048-4095: 2, ...)."""
    return 0 if context < CONTEXT_FLOOR else (context // CONTEXT_FLOOR).bit_length()


class ContextCosts:
    """The forward cost at each context length: one :class:`ForwardCost` per :func:`context_bucket`, so that a
    verification at 8K cached positions is priced by forwards at 4-8K, not by the short prompts before it. A bucket
    seen for the first time starts from the line of the nearest bucket seen (else ``prior``); ``single``: one
    :class:`ForwardCost` for every context (a caller that prices one context)."""

    def __init__(self, prior: tuple[float, float] = (1.0, 1.0 / 32), window: int = 128,
                 single: ForwardCost | None = None) -> None:
        self.prior, self.window, self.single = prior, window, single
        self.buckets: dict[int, ForwardCost] = {}

    def at(self, context: int) -> ForwardCost:
        """The cost model of forwards after ``context`` cached positions."""
        if self.single is not None:
            return self.single
        bucket = context_bucket(context)
        if bucket not in self.buckets:
            seen = [b for b, cost in self.buckets.items() if cost.samples]
            nearest = min(seen, key=lambda b: (abs(b - bucket), b), default=None)
            prior = self.prior if nearest is None else self.buckets[nearest].coefficients()
            self.buckets[bucket] = ForwardCost(self.window, prior)
        return self.buckets[bucket]


@dataclass(frozen=True)
class StepCosts:
    draft_s: float  # D: drafting one block alone (seconds)
    verify_s: float  # V: one verification pass alone (seconds)
    hit_rate: float  # h: share of steps whose pre-draft matched the outcome (all accepted, bonus guessed)
    ahead_s: float | None = None  # A: pre-drafting one block ahead alone; None: D * (k + 1) / k
    num_draft_tokens: int = 4  # k, for the default A
    target_slowdown: float = 1.0  # s_V: verification time while the drafter runs / alone
    drafter_slowdown: float = 1.0  # s_D: drafting time while the target runs / alone

    @property
    def ahead(self) -> float:
        if self.ahead_s is not None:
            return self.ahead_s
        return self.draft_s * (self.num_draft_tokens + 1) / self.num_draft_tokens

    def sync_step(self) -> float:
        return self.draft_s + self.verify_s

    def overlap_step(self) -> float:
        concurrent = max(self.target_slowdown * self.verify_s, self.drafter_slowdown * self.ahead)
        return concurrent + (1.0 - self.hit_rate) * self.draft_s

    def overlap_speedup(self) -> float:
        """Predicted tokens/s of overlap over sync (> 1: overlap wins)."""
        return self.sync_step() / self.overlap_step()


def break_even_slowdown(costs: StepCosts) -> float:
    """The common slowdown s = s_V = s_D at which overlap stops paying (speedup 1)."""
    concurrent = max(costs.verify_s, costs.ahead)
    return (costs.sync_step() - (1.0 - costs.hit_rate) * costs.draft_s) / concurrent
