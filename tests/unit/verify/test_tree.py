"""Tree layouts compiled from hand-drawn trees, tree attention, and greedy / sampled tree verification."""

import math

import pytest
import torch

from dflash2.verify import (
    TreeVerdict,
    canonical_paths,
    compile_tree,
    target_positions,
    tree_attention_mask,
    tree_from_paths,
    verify_tree,
    verify_tree_greedy,
)

VOCAB = 10

#            root
#          /      \
#      n0 (0,)    n1 (1,)
#      /    \        \
#  n2 (0,0) n3 (0,1)  n4 (1,0)
#     |
#  n5 (0,0,0)
PATHS = [(1, 0), (0,), (0, 0, 0), (1,), (0, 1), (0, 0)]  # deliberately unsorted
PARENTS = [-1, -1, 0, 0, 1, 2]
NODE_TOKENS = torch.tensor([5, 7, 2, 3, 2, 9])


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def one_hot(ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_tree_from_paths_orders_by_depth_then_rank():
    assert canonical_paths(PATHS) == [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree_from_paths(PATHS) == PARENTS


@pytest.mark.parametrize(
    "paths",
    [[(0,), (0,)], [(0, 0)], [(0,), (1, 0)], [()], [(0,), (-1,)]],
    ids=["duplicate", "missing-parent", "missing-sibling-parent", "empty", "negative"],
)
def test_tree_from_paths_rejects_bad_paths(paths):
    with pytest.raises(ValueError):
        tree_from_paths(paths)


def test_compile_hand_drawn_tree():
    layout = compile_tree(PARENTS)
    assert layout.num_nodes == 6
    assert layout.parents.tolist() == PARENTS
    assert layout.depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert layout.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())
    expected = torch.tensor(
        [  # r  n0 n1 n2 n3 n4 n5
            [1, 0, 0, 0, 0, 0, 0],  # root
            [1, 1, 0, 0, 0, 0, 0],  # n0
            [1, 0, 1, 0, 0, 0, 0],  # n1
            [1, 1, 0, 1, 0, 0, 0],  # n2
            [1, 1, 0, 0, 1, 0, 0],  # n3
            [1, 0, 1, 0, 0, 1, 0],  # n4
            [1, 1, 0, 1, 0, 0, 1],  # n5
        ],
        dtype=torch.bool,
    )
    assert torch.equal(layout.attn_mask, expected)


def test_chain_tree_is_causal():
    layout = compile_tree([-1, 0, 1, 2])
    assert torch.equal(layout.attn_mask, torch.ones(5, 5, dtype=torch.bool).tril())
    assert layout.depth.tolist() == [0, 1, 2, 3, 4]
    assert layout.children == ((0,), (1,), (2,), (3,), ())


def test_empty_tree_is_root_only():
    layout = compile_tree([])
    assert layout.children == ((),)
    assert layout.attn_mask.tolist() == [[True]]
    verdict = verify_tree_greedy(layout, torch.zeros(0, dtype=torch.int64), one_hot([4]))
    assert verdict.tokens.tolist() == [4] and verdict.accepted_nodes == []


@pytest.mark.parametrize("parents", [[0], [-2], [1, -1], [-1, 1]])
def test_compile_rejects_parents_after_children(parents):
    with pytest.raises(ValueError):
        compile_tree(parents)


def test_positions_and_mask_with_prefix():
    layout = compile_tree(PARENTS)
    assert target_positions(layout, 10).tolist() == [10, 11, 11, 12, 12, 12, 13]
    mask = tree_attention_mask(layout, 4)
    assert mask.shape == (7, 11) and mask.dtype == torch.bool
    assert mask[:, :4].all()
    assert torch.equal(mask[:, 4:], layout.attn_mask)


def test_tree_attention_equals_causal_attention_over_each_branch():
    """Each node's attention output with the tree mask equals plain causal attention over prefix + its branch."""
    layout = compile_tree(PARENTS)
    prefix_len, n, dim = 3, layout.num_nodes, 8
    g = gen(1)
    query, key, value = (torch.randn(prefix_len + n + 1, dim, generator=g) for _ in range(3))  # [prefix + n + 1, dim]
    mask = tree_attention_mask(layout, prefix_len)  # [n + 1, prefix + n + 1]
    scores = query[prefix_len:] @ key.T / math.sqrt(dim)  # [n + 1, prefix + n + 1]
    tree_out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ value  # [n + 1, dim]
    for position in range(n + 1):
        branch = [position]  # verify-input indices from this position up to the root
        while branch[-1] != 0:
            branch.append(int(layout.parents[branch[-1] - 1]) + 1)
        rows = list(range(prefix_len)) + [prefix_len + j for j in reversed(branch)]  # the sequence this node sees
        causal_scores = query[prefix_len + position] @ key[rows].T / math.sqrt(dim)  # [len(rows)]
        causal_out = torch.softmax(causal_scores, dim=-1) @ value[rows]  # [dim]
        torch.testing.assert_close(tree_out[position], causal_out)
        assert int(target_positions(layout, prefix_len)[position]) == len(rows) - 1


def greedy_logits(argmax_by_position: dict[int, int]) -> torch.Tensor:
    """[n + 1, vocab] random logits with the given argmax at the listed verify-input positions."""
    logits = torch.randn(len(PARENTS) + 1, VOCAB, generator=gen(2))
    for position, token in argmax_by_position.items():
        logits[position, token] = 10.0
    return logits


@pytest.mark.parametrize(
    "argmax, accepted, tokens",
    [
        ({0: 7, 2: 2, 5: 4}, [1, 4], [7, 2, 4]),  # right branch to the leaf n4, bonus 4
        ({0: 5, 1: 3, 4: 8}, [0, 3], [5, 3, 8]),  # second child of n0, bonus below the leaf
        ({0: 5, 1: 2, 3: 9, 6: 1}, [0, 2, 5], [5, 2, 9, 1]),  # deepest path, bonus
        ({0: 5, 1: 2, 3: 0}, [0, 2], [5, 2, 0]),  # n5 (token 9) rejected, recovered 0
        ({0: 1}, [], [1]),  # no root child matches
    ],
)
def test_greedy_tree_follows_the_argmax(argmax, accepted, tokens):
    verdict = verify_tree_greedy(compile_tree(PARENTS), NODE_TOKENS, greedy_logits(argmax))
    assert isinstance(verdict, TreeVerdict)
    assert verdict.accepted_nodes == accepted
    assert verdict.tokens.tolist() == tokens
    assert verdict.tokens.dtype == torch.int64
    assert verdict.kept_positions == [0] + [node + 1 for node in accepted]


def test_greedy_tree_with_duplicate_sibling_tokens_takes_the_first():
    layout = compile_tree([-1, -1])
    verdict = verify_tree_greedy(layout, torch.tensor([3, 3]), one_hot([3, 4, 5]))
    assert verdict.accepted_nodes == [0] and verdict.tokens.tolist() == [3, 4]


@pytest.mark.parametrize("with_q", [True, False])
def test_sampled_tree_with_one_hot_target_is_deterministic(with_q):
    layout = compile_tree(PARENTS)
    p_target = one_hot([5, 2, 0, 9, 1, 1, 6])  # [n + 1, vocab]: path n0 -> n2 -> n5 then bonus 6
    q_draft = torch.full((7, VOCAB), 1.0 / VOCAB) if with_q else None
    for seed in range(5):
        verdict = verify_tree(layout, NODE_TOKENS, p_target, q_draft, gen(seed))
        assert verdict.accepted_nodes == [0, 2, 5]
        assert verdict.tokens.tolist() == [5, 2, 9, 6]


def test_sampled_tree_target_off_the_tree_recovers():
    layout = compile_tree(PARENTS)
    p_target = one_hot([4, 2, 0, 9, 1, 1, 6])  # token 4 is no child of the root
    for q_draft in (None, torch.full((7, VOCAB), 1.0 / VOCAB)):
        verdict = verify_tree(layout, NODE_TOKENS, p_target, q_draft, gen())
        assert verdict.accepted_nodes == [] and verdict.tokens.tolist() == [4]


# Root with children a (token 0) then b (token 1). p = [.2, .5, .3], q = [.6, .4, 0].
# a: p/q = 1/3. After rejecting a: p := norm(max(p - q, 0)) = [0, .25, .75]; q := q without a = [0, 1, 0].
# b: p/q = 0.25 (it would be 0.5 / 0.4 without the updates).
SIBLING_P = torch.tensor([[0.2, 0.5, 0.3, 0, 0, 0, 0, 0, 0, 0]] + [[0.0] * 9 + [1.0]] * 2)  # [3, vocab]
SIBLING_Q = torch.tensor([[0.6, 0.4, 0, 0, 0, 0, 0, 0, 0, 0]] * 3)  # [3, vocab]


@pytest.mark.parametrize(
    "uniforms, accepted, first_token",
    [
        ([0.3, 0.99], [0], 0),  # a accepted (0.3 < 1/3)
        ([0.4, 0.2], [1], 1),  # a rejected, b accepted (0.2 < 0.25)
        ([0.4, 0.3], [], 2),  # both rejected: the final residual [0, 0, 1] gives 2
    ],
)
def test_recursive_rejection_over_siblings(uniforms, accepted, first_token):
    layout = compile_tree([-1, -1])
    verdict = verify_tree(layout, torch.tensor([0, 1]), SIBLING_P, SIBLING_Q, gen(), uniforms=torch.tensor(uniforms))
    assert verdict.accepted_nodes == accepted
    assert verdict.tokens[0].item() == first_token
    assert verdict.tokens.tolist()[1:] == ([9] if accepted else [])  # bonus below the leaf is certain


def test_tree_inputs_are_validated():
    layout = compile_tree(PARENTS)
    p_target = torch.full((7, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError):
        verify_tree(layout, torch.tensor([5, 7, 2, 3, 2, VOCAB]), p_target, None, gen())
    with pytest.raises(ValueError):
        verify_tree(layout, NODE_TOKENS[:5], p_target, None, gen())
    with pytest.raises(ValueError):
        verify_tree(layout, NODE_TOKENS, p_target[:6], None, gen())
    with pytest.raises(ValueError):
        verify_tree(layout, NODE_TOKENS, p_target, p_target[:6], gen())
    with pytest.raises(ValueError):
        verify_tree_greedy(layout, torch.tensor([5, 7, 2, 3, 2, -1]), p_target)
