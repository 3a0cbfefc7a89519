"""verify_tree is lossless: emitted tokens are distributed as tokens sampled from the target one by one.

Same Markov setup as test_rejection_distribution.py: the target emits token 0 ~ p0 and every later token
~ P[previous token]; the drafter is (q0, Q). For each of N trials the children of every tree position are drawn
from the drafter's distribution at that position, without replacement (sampled siblings) — the same draws serve
as "deterministic" children for the q_draft=None rule. verify_tree is a Python loop over the trials, so N = 2e4;
the chi-square test (p-value > 1e-3, fixed seeds) still rejects a broken rule, see test_broken_tree_rule_is_caught.
"""

from __future__ import annotations

import pytest
import torch

from tests.statistical.chisq import chi_square_p_value
from dflash2.verify import SamplingParams, TreeLayout, compile_tree, logits_to_probs, sample, tree_from_paths, verify_tree

VOCAB = 6
NUM_TRIALS = 20_000
MIN_P_VALUE = 1e-3

# root: 3 sampled children; n0: 2; n1: 1; n0's first child: 1 (depth 3)
LAYOUT = compile_tree(tree_from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]))




def draw_trees(
    layout: TreeLayout,
    q0: torch.Tensor,  # [vocab]
    Q: torch.Tensor,  # [vocab, vocab]
    p0: torch.Tensor,  # [vocab]
    P: torch.Tensor,  # [vocab, vocab]
    num: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node tokens [N, n], p_target [N, n + 1, vocab], q_draft [N, n + 1, vocab] for N independent trials."""
    n = layout.num_nodes
    node_tokens = torch.empty(num, n, dtype=torch.int64)
    p_target = torch.empty(num, n + 1, VOCAB)
    q_draft = torch.empty(num, n + 1, VOCAB)
    for position in range(n + 1):  # parents come before children, so each parent's token is known
        if position == 0:
            p_target[:, 0], q_draft[:, 0] = p0, q0
        else:
            token = node_tokens[:, position - 1]  # [N]
            p_target[:, position], q_draft[:, position] = P[token], Q[token]
        children = list(layout.children[position])
        if children:  # sequential sampling without replacement (torch's exponential race is exactly that)
            node_tokens[:, children] = torch.multinomial(q_draft[:, position], len(children), generator=generator)
    return node_tokens, p_target, q_draft


def first_tokens(layout, node_tokens, p_target, q_draft, P, generator) -> torch.Tensor:
    """[N, 3]: the first three emitted tokens, completed by sampling from the target when a step emits fewer."""
    num = node_tokens.shape[0]
    q_rows = [None] * num if q_draft is None else q_draft.unbind(0)
    emitted = [
        verify_tree(layout, tokens, p, q, generator).tokens.tolist()[:3]
        for tokens, p, q in zip(node_tokens.unbind(0), p_target.unbind(0), q_rows)
    ]
    counts = torch.tensor([len(row) for row in emitted])  # [N]
    out = torch.tensor([row + [-1] * (3 - len(row)) for row in emitted])  # [N, 3]
    for j in (1, 2):
        continuation = sample(P[out[:, j - 1]], generator)  # [N]
        out[:, j] = torch.where(counts <= j, continuation, out[:, j])
    return out


def assert_lossless(sequences: torch.Tensor, p0: torch.Tensor, P: torch.Tensor) -> None:
    p_value = chi_square_p_value(torch.bincount(sequences[:, 0], minlength=VOCAB), p0)
    assert p_value > MIN_P_VALUE, f"first token: p-value {p_value:.2e}"
    marginal = p0
    for j in (0, 1):
        pairs = sequences[:, j] * VOCAB + sequences[:, j + 1]
        p_value = chi_square_p_value(torch.bincount(pairs, minlength=VOCAB * VOCAB), marginal[:, None] * P)
        assert p_value > MIN_P_VALUE, f"tokens ({j}, {j + 1}): p-value {p_value:.2e}"
        marginal = marginal @ P


def dist(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(1.5 * torch.randn(*shape, VOCAB, generator=g), dim=-1)


def warped_target() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    probs = logits_to_probs(2.0 * torch.randn(VOCAB + 1, VOCAB, generator=g), SamplingParams(temperature=0.8, top_k=4, top_p=0.9))
    return probs[0], probs[1:]


CASES = {
    "q_differs": (dist(seed=1), dist(VOCAB, seed=2)),
    "top_k_top_p_target": warped_target(),  # p with zeros; q keeps full support (3 siblings drawn without replacement)
}
DRAFTER = (dist(seed=3), dist(VOCAB, seed=4))


@pytest.mark.parametrize(
    "case, q_mode", [("q_differs", "sampled"), ("q_differs", "deterministic"), ("top_k_top_p_target", "sampled")]
)
def test_tree_verification_is_lossless(case, q_mode):
    p0, P = CASES[case]
    q0, Q = DRAFTER
    generator = torch.Generator().manual_seed(21)
    node_tokens, p_target, q_draft = draw_trees(LAYOUT, q0, Q, p0, P, NUM_TRIALS, generator)
    sequences = first_tokens(LAYOUT, node_tokens, p_target, q_draft if q_mode == "sampled" else None, P, generator)
    assert_lossless(sequences, p0, P)


def test_q_equal_to_p_accepts_a_root_child_and_stays_lossless():
    """Siblings drawn from p itself: the first child is always accepted (p/q = 1); no NaN from zero residuals."""
    p0, P = CASES["q_differs"]
    generator = torch.Generator().manual_seed(22)
    node_tokens, p_target, q_draft = draw_trees(LAYOUT, p0, P, p0, P, 2_000, generator)
    for trial in range(2_000):
        verdict = verify_tree(LAYOUT, node_tokens[trial], p_target[trial], q_draft[trial], generator)
        assert verdict.accepted_nodes[:1] == [0]
        assert 0 <= int(verdict.tokens.min()) and int(verdict.tokens.max()) < VOCAB


def test_broken_tree_rule_is_caught():
    """Always accepting the first sibling (uniforms pinned to 0) makes token 0 follow q0: the test must notice."""
    p0, P = CASES["q_differs"]
    q0, Q = DRAFTER
    generator = torch.Generator().manual_seed(23)
    num = 5_000
    node_tokens, p_target, q_draft = draw_trees(LAYOUT, q0, Q, p0, P, num, generator)
    pinned = torch.zeros(LAYOUT.num_nodes)
    first = torch.tensor(
        [int(verify_tree(LAYOUT, node_tokens[t], p_target[t], q_draft[t], generator, uniforms=pinned).tokens[0]) for t in range(num)]
    )
    assert chi_square_p_value(torch.bincount(first, minlength=VOCAB), p0) < MIN_P_VALUE
