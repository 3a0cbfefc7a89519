from dflash2.drafters.ngram import NgramDrafter, find_ngram_candidates, find_ngram_continuation, merge_into_tree
from dflash2.verify import GREEDY, compile_tree


def test_longest_match_wins():
    # suffix [7, 8, 9]: the 3-gram occurs once (followed by 50), the 1-gram [9] also occurs followed by 60
    sequence = [9, 60, 1, 7, 8, 9, 50, 51, 2, 7, 8, 9]
    assert find_ngram_continuation(sequence, 2, max_n=3) == [50, 51]


def test_earliest_occurrence_wins_among_equals():
    sequence = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert find_ngram_continuation(sequence, 2, max_n=2) == [10, 11]


def test_never_proposes_past_eos():
    sequence = [3, 4, 99, 42, 43, 3, 4]
    assert find_ngram_continuation(sequence, 5, max_n=2, stop_ids={99}) == [99]


def test_no_match_gives_no_draft_and_continuation_is_capped():
    assert find_ngram_continuation([1, 2, 3, 4], 4) == []
    assert find_ngram_continuation([1, 2, 3, 1], 1) == [2]
    assert find_ngram_continuation([1, 2, 3, 1], 8) == [2, 3, 1]  # may run into the suffix itself


def test_candidates_are_distinct_and_ordered():
    sequence = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6, 10, 11, 7, 6]
    # suffix [7, 6] has no 2-gram match; [6] is followed by [10, 11], [20, 21], [10, 11] again (a duplicate)
    assert find_ngram_candidates(sequence, 2, 3, max_n=2) == [[10, 11], [20, 21]]


def test_merge_into_tree_shares_prefixes():
    tokens, parents = merge_into_tree([[1, 2, 3], [1, 2, 4], [5]])
    assert tokens == [1, 2, 3, 4, 5]
    assert parents == [-1, 0, 1, 1, -1]
    compile_tree(parents)  # a valid tree


def test_drafter_returns_a_tree_only_for_several_candidates():
    sequence = [5, 6, 10, 11, 5, 6, 20, 21, 6]
    chain = NgramDrafter(2).propose(sequence, 2, GREEDY, None)
    assert chain.parents is None and chain.tokens.tolist() == [10, 11]
    tree = NgramDrafter(2, num_candidates=2).propose(sequence, 2, GREEDY, None)
    assert tree.tokens.tolist() == [10, 11, 20, 21] and tree.parents == [-1, 0, -1, 2]
    assert tree.depth == 2
