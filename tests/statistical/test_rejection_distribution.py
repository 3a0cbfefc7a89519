"""verify_chain is lossless: the emitted tokens are distributed as tokens sampled from the target one by one.

Setup. A tiny vocabulary and a Markov target: the first token ~ p0, every later token ~ P[previous token]. The
drafter is Markov too (q0, Q). One batched call verifies N = 1e5 independent chains (batch = samples), with
p_target / q_draft built per row from that row's drafts, exactly as a real target / drafter would score them.
Each row's emitted tokens are then completed to k + 1 tokens by sampling from the target, so that if and only
if verification is lossless, token 0 ~ p0 and (token j, token j + 1) ~ m_j x P with m_{j+1} = m_j @ P.
Checked with a chi-square test at p-value > 1e-3 (fixed seeds, so the outcome is deterministic);
test_broken_rules_are_caught shows the same test rejects wrong rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.statistical.chisq import chi_square_p_value
from dflash2.verify import ChainVerdict, SamplingParams, logits_to_probs, sample, verify_chain, verify_greedy

VOCAB = 6
K = 3
NUM_SAMPLES = 100_000
MIN_P_VALUE = 1e-3




def counts_of(tokens: torch.Tensor, cells: int) -> torch.Tensor:
    """[N] ids -> [cells] counts."""
    return torch.bincount(tokens, minlength=cells)


@dataclass
class Chain:
    """Markov target (p0, P) and drafter (q0, Q)."""

    p0: torch.Tensor  # [vocab]
    P: torch.Tensor  # [vocab, vocab], row a = target distribution after token a
    q0: torch.Tensor  # [vocab]
    Q: torch.Tensor  # [vocab, vocab]


@dataclass
class Batch:
    drafts: torch.Tensor  # [N, k] int64
    p_target: torch.Tensor  # [N, k + 1, vocab]
    q_draft: torch.Tensor  # [N, k, vocab], what each draft was sampled from


def make_batch(chain: Chain, k: int, num: int, generator: torch.Generator) -> Batch:
    """Draw N chains of k drafts from the drafter and score them with the target."""
    drafts = torch.empty(num, k, dtype=torch.int64)
    q_rows, p_rows = [], [chain.p0.expand(num, VOCAB)]
    for i in range(k):
        q_i = chain.q0.expand(num, VOCAB) if i == 0 else chain.Q[drafts[:, i - 1]]  # [N, vocab]
        drafts[:, i] = sample(q_i, generator)
        q_rows.append(q_i)
        p_rows.append(chain.P[drafts[:, i]])
    return Batch(drafts=drafts, p_target=torch.stack(p_rows, dim=1), q_draft=torch.stack(q_rows, dim=1))


def complete_with_target(verdict: ChainVerdict, P: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[N, k + 1] sequences: the emitted tokens, then tokens sampled from the target after them."""
    sequences = verdict.tokens.clone()
    for j in range(1, sequences.shape[1]):
        missing = j > verdict.num_accepted  # [N]
        continuation = sample(P[sequences[:, j - 1].clamp_min(0)], generator)  # [N]
        sequences[:, j] = torch.where(missing, continuation, sequences[:, j])
    return sequences


def assert_lossless(sequences: torch.Tensor, chain: Chain) -> None:
    """Token 0 ~ p0 and each consecutive pair ~ m_j x P (sequences: [N, k + 1])."""
    p_value = chi_square_p_value(counts_of(sequences[:, 0], VOCAB), chain.p0)
    assert p_value > MIN_P_VALUE, f"first token: p-value {p_value:.2e}"
    marginal = chain.p0
    for j in range(sequences.shape[1] - 1):
        joint = marginal[:, None] * chain.P  # [vocab, vocab]
        pairs = sequences[:, j] * VOCAB + sequences[:, j + 1]  # [N]
        p_value = chi_square_p_value(counts_of(pairs, VOCAB * VOCAB), joint)
        assert p_value > MIN_P_VALUE, f"tokens ({j}, {j + 1}): p-value {p_value:.2e}"
        marginal = marginal @ chain.P


def random_dist(*shape: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(*shape, VOCAB, generator=g), dim=-1)


def with_zeros(dist: torch.Tensor, zero_ids: list[int]) -> torch.Tensor:
    dist = dist.clone()
    dist[..., zero_ids] = 0.0
    return dist / dist.sum(-1, keepdim=True)


def over_top_candidates(dist: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    """A path selector's sparse q: a fresh softmax over each row's ``count`` most likely ids, zero elsewhere."""
    candidates = dist.topk(count, dim=-1).indices
    scores = torch.randn(*dist.shape, generator=torch.Generator().manual_seed(seed))
    sparse = torch.full_like(dist, float("-inf")).scatter(-1, candidates, scores.gather(-1, candidates))
    return torch.softmax(sparse, dim=-1)


def warped(seed: int, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(VOCAB + 1, VOCAB, generator=g)  # row 0 -> first token, rows 1.. -> after token a
    probs = logits_to_probs(logits, params)
    return probs[0], probs[1:]


def chains() -> dict[str, Chain]:
    p0, P = random_dist(seed=1), random_dist(VOCAB, seed=2)
    q0, Q = random_dist(seed=3), random_dist(VOCAB, seed=4)
    low, high = [3, 4, 5], [0, 1, 2]
    target_params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    draft_params = SamplingParams(temperature=1.0, top_k=3)
    wp0, wP = warped(5, target_params)
    wq0, wQ = warped(6, draft_params)
    return {
        "q_differs": Chain(p0, P, q0, Q),
        "q_equals_p": Chain(p0, P, p0, P),
        "disjoint_supports": Chain(with_zeros(p0, low), with_zeros(P, low), with_zeros(q0, high), with_zeros(Q, high)),
        "p_with_zeros": Chain(with_zeros(p0, [0, 3]), with_zeros(P, [1, 4]), q0, Q),
        "top_k_top_p": Chain(wp0, wP, wq0, wQ),
        "selector_sparse_q": Chain(p0, P, over_top_candidates(q0, 3, seed=7), over_top_candidates(Q, 3, seed=8)),
    }


CHAINS = chains()


@pytest.mark.parametrize("name", list(CHAINS))
def test_sampled_drafts_are_lossless(name):
    chain = CHAINS[name]
    generator = torch.Generator().manual_seed(11)
    batch = make_batch(chain, K, NUM_SAMPLES, generator)
    verdict = verify_chain(batch.drafts, batch.p_target, batch.q_draft, generator)
    assert not torch.isnan(verdict.tokens.float()).any()
    assert verdict.tokens.min() >= -1 and verdict.tokens.max() < VOCAB
    assert_lossless(complete_with_target(verdict, chain.P, generator), chain)

    # acceptance of draft 0 happens with probability sum(min(p0, q0)) = 1 - TV(p0, q0)
    rate = (verdict.num_accepted > 0).double().mean().item()
    expected = torch.minimum(chain.p0, chain.q0).sum().item()
    assert abs(rate - expected) < 5 * (max(expected * (1 - expected), 1e-6) / NUM_SAMPLES) ** 0.5 + 1e-6
    if name == "q_equals_p":
        assert rate > 0.999
    if name == "disjoint_supports":
        assert rate == 0.0


@pytest.mark.parametrize("q_mode", ["one_hot", "none"])
@pytest.mark.parametrize("name", ["q_differs", "p_with_zeros", "top_k_top_p"])
def test_deterministic_drafts_are_lossless(name, q_mode):
    """q one-hot (explicit, or None): the drafts can come from anywhere; here from the drafter chain."""
    chain = CHAINS[name]
    generator = torch.Generator().manual_seed(12)
    batch = make_batch(chain, K, NUM_SAMPLES, generator)
    q_draft = torch.nn.functional.one_hot(batch.drafts, VOCAB).float() if q_mode == "one_hot" else None
    verdict = verify_chain(batch.drafts, batch.p_target, q_draft, generator)
    assert_lossless(complete_with_target(verdict, chain.P, generator), chain)
    rate = (verdict.num_accepted > 0).double().mean().item()
    expected = (chain.q0 * chain.p0).sum().item()  # draft x accepted with probability p0(x)
    assert abs(rate - expected) < 5 * (expected * (1 - expected) / NUM_SAMPLES) ** 0.5


def test_zero_drafts_bonus_is_distributed_as_p():
    chain = CHAINS["p_with_zeros"]
    generator = torch.Generator().manual_seed(13)
    p_target = chain.p0.expand(NUM_SAMPLES, 1, VOCAB)
    verdict = verify_chain(torch.zeros(NUM_SAMPLES, 0, dtype=torch.int64), p_target, None, generator)
    assert chi_square_p_value(counts_of(verdict.tokens[:, 0], VOCAB), chain.p0) > MIN_P_VALUE


def forget_the_residual(batch: Batch, generator: torch.Generator) -> torch.Tensor:
    """Broken: accept with min(1, p/q) but, at a rejection, sample from p instead of the residual. Token 0: [N]."""
    p0, q0 = batch.p_target[:, 0], batch.q_draft[:, 0]  # [N, vocab]
    x = batch.drafts[:, 0]  # [N]
    u = torch.rand(x.shape, generator=generator)
    accept = u * q0.gather(1, x[:, None]).squeeze(1) < p0.gather(1, x[:, None]).squeeze(1)
    return torch.where(accept, x, sample(p0, generator))


BROKEN_RULES = {
    # compare to the target's argmax at temperature > 0
    "argmax": lambda batch, g: verify_greedy(batch.drafts, batch.p_target.log()).tokens[:, 0],
    "forget_residual": forget_the_residual,
    # never reject (q = 0 reads as p / q = inf): the output follows q
    "always_accept": lambda batch, g: verify_chain(batch.drafts, batch.p_target, torch.zeros_like(batch.q_draft), g).tokens[:, 0],
    # p and q swapped
    "p_q_swapped": lambda batch, g: verify_chain(
        batch.drafts,
        torch.cat([batch.q_draft, batch.p_target[:, 1:]], dim=1),
        batch.p_target[:, :1],
        g,
    ).tokens[:, 0],
}


@pytest.mark.parametrize("rule", list(BROKEN_RULES))
def test_broken_rules_are_caught(rule):
    """The same sample size and threshold reject a lossy rule (and accept the real one on the same drafts)."""
    chain = CHAINS["q_differs"]
    generator = torch.Generator().manual_seed(14)
    batch = make_batch(chain, 1, NUM_SAMPLES, generator)
    first = BROKEN_RULES[rule](batch, generator)
    assert chi_square_p_value(counts_of(first, VOCAB), chain.p0) < MIN_P_VALUE
    right = verify_chain(batch.drafts, batch.p_target, batch.q_draft, generator).tokens[:, 0]
    assert chi_square_p_value(counts_of(right, VOCAB), chain.p0) > MIN_P_VALUE
