"""Drafts shaped by a grammar (drafters/grammar.py): no shaped draft holds a token the grammar forbids, forced runs
are proposed (past the drafter's length too), the grammar state is back where it was, sampled replacements come
with the distribution they were drawn from; and through the batch engine constrained speculative output equals
constrained plain output (greedy)."""

from __future__ import annotations

import random

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, run_to_completion
from dflash2.drafters.base import Draft, Drafter
from dflash2.drafters.grammar import GrammarDrafter
from dflash2.serve.structured import RequestConstraint
from dflash2.verify import SamplingParams
from tests.unit.verify.test_grammar_constraint import ModGrammar, ReplayDrafter, constrained_run, engine  # noqa: F401


class SlotGrammar(ModGrammar):
    """Slots in order: a fixed token (forced) or a set to choose from; then ``stop``. ``forced_tokens`` is the run
    of fixed slots ahead (like xgrammar's jump-forward tokens)."""

    def __init__(self, vocab: int, slots: list[int | set[int]], stop: int) -> None:
        super().__init__(vocab, stop=stop)
        self.slots = slots

    def allowed(self, token: int) -> bool:
        if self.terminated():
            return False
        at = len(self.accepted)
        if at == len(self.slots):
            return token == self.stop
        slot = self.slots[at]
        return token == slot if isinstance(slot, int) else token in slot

    def forced_tokens(self) -> list[int]:
        run = []
        for slot in self.slots[len(self.accepted):]:
            if not isinstance(slot, int) or self.terminated():
                break
            run.append(slot)
        return run


class FixedDrafter(Drafter):
    """Proposes ``tokens`` (and ``q``, a sampled chain, when given) whatever the sequence."""

    name = "fixed"

    def __init__(self, tokens: list[int], q: torch.Tensor | None = None) -> None:
        super().__init__(max(len(tokens), 1))
        self.tokens, self.q = tokens, q

    def propose(self, sequence, num_draft_tokens, params, generator) -> Draft:
        q = None if self.q is None else self.q[:num_draft_tokens]
        return Draft(torch.tensor(self.tokens[:num_draft_tokens], dtype=torch.int64), q)


GREEDY = SamplingParams()


def test_forced_runs_are_drafted_past_the_drafters_length():
    grammar = SlotGrammar(20, [{1, 2}, 7, 8, 9, {3, 4}, 10, {5}], stop=0)
    grammar.accept(1)
    wrapper = GrammarDrafter(FixedDrafter([7, 8]), grammar)
    draft = wrapper.propose([1], 2, GREEDY, None)
    assert draft.tokens.tolist() == [7, 8, 9]  # the drafter's two, then the forced 9; then a choice: the end
    assert grammar.accepted == [1]
    # a drafter that guesses wrong: the forced run replaces its tokens, the rest (drafted for another prefix) goes
    draft = GrammarDrafter(FixedDrafter([3, 4, 10]), grammar).propose([1], 3, GREEDY, None)
    assert draft.tokens.tolist() == [7, 8, 9]
    grammar.accept(7)
    grammar.accept(8)
    grammar.accept(9)
    draft = GrammarDrafter(FixedDrafter([4, 10, 5, 0, 6]), grammar).propose([1], 5, GREEDY, None)
    assert draft.tokens.tolist() == [4, 10, 5, 0]  # forced 10 agrees with the drafter; the stop ends it
    draft = GrammarDrafter(FixedDrafter([6, 10]), grammar).propose([1], 2, GREEDY, None)
    assert draft.tokens.tolist() == []  # 6 is forbidden where the grammar gives a choice: nothing to propose
    assert grammar.accepted == [1, 7, 8, 9]


@pytest.mark.parametrize("seed", range(30))
def test_shaped_drafts_never_hold_a_forbidden_token(seed):
    rng = random.Random(seed)
    vocab = 30
    grammar = ModGrammar(vocab, length=rng.randint(3, 12), stop=0)
    for _ in range(rng.randint(0, 2)):
        grammar.accept(next(t for t in rng.sample(range(vocab), vocab) if grammar.allowed(t)))
    before = list(grammar.accepted)
    k = rng.randint(1, 8)
    tokens = [rng.randrange(vocab) for _ in range(k)]
    sampled = seed % 2 == 1
    q = torch.softmax(torch.randn(k, vocab), -1) if sampled else None
    draft = GrammarDrafter(FixedDrafter(tokens, q), grammar).propose([1], k, GREEDY, None)
    assert grammar.accepted == before
    fresh = ModGrammar(vocab, length=grammar.length, stop=0)
    assert all(fresh.accept(t) for t in before + draft.tokens.tolist())
    walk = ModGrammar(vocab, length=grammar.length, stop=0)
    assert all(walk.accept(t) for t in before)
    allowed = 0  # the drafter's tokens up to its first forbidden one
    while allowed < k and walk.accept(tokens[allowed]):
        allowed += 1
    assert draft.tokens.tolist()[:allowed] == tokens[: min(allowed, len(draft.tokens))]
    if not sampled:
        assert draft.q_draft is None
        assert len(draft.tokens) >= allowed or fresh.terminated()
    else:  # the first forbidden one replaced; each row a distribution holding its token
        assert len(draft.tokens) >= min(k, allowed + 1) or fresh.terminated()
        assert torch.allclose(draft.q_draft.sum(-1), torch.ones(len(draft.tokens)))
        assert (draft.q_draft[torch.arange(len(draft.tokens)), draft.tokens] > 0).all()


def test_lookups_continue_earlier_occurrences_the_grammar_allows():
    grammar = ModGrammar(40)  # t may follow l iff t != l and (l + t) % 3 != 0
    sequence = [1, 3, 7, 9, 4, 12, 22, 1, 3]
    assert all(grammar.accept(t) for t in sequence)
    draft = GrammarDrafter(FixedDrafter([0] * 6), grammar).free_draft(sequence)  # up to its k = 6 looked up
    assert draft.tokens.tolist()[:4] == [7, 9, 4, 12]  # what followed "1 3" before
    assert grammar.accepted == sequence
    # a continuation the grammar forbids is not proposed: 9 -> 3 is allowed in the text, not by (9 + 3) % 3
    grammar = ModGrammar(40)
    grammar.accepted = [9]
    assert GrammarDrafter(FixedDrafter([]), grammar).free_draft([9, 3, 9]) is None


def test_a_sampled_forbidden_draft_is_replaced_with_its_distribution():
    grammar = ModGrammar(6)
    grammar.accept(1)  # then 0, 3 or 4 (not 1, 2, 5)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.15, 0.05, 0.2]])
    draft = GrammarDrafter(FixedDrafter([2], q), grammar).propose([1], 1, GREEDY, None)
    assert draft.tokens.tolist() == [3]  # the likeliest allowed
    expected = torch.tensor([0.1, 0.0, 0.0, 0.15 + 0.2 + 0.3 + 0.2, 0.05, 0.0])
    assert torch.allclose(draft.q_draft[0], expected)


def test_forced_tokens_in_a_sampled_chain_are_one_hot():
    grammar = SlotGrammar(8, [{1, 2}, 5, {3, 4}], stop=0)
    q = torch.full((3, 8), 1 / 8)
    draft = GrammarDrafter(FixedDrafter([2, 5, 3], q), grammar).propose([1], 3, GREEDY, None)
    assert draft.tokens.tolist() == [2, 5, 3]
    assert torch.equal(draft.q_draft[1], torch.nn.functional.one_hot(torch.tensor(5), 8).float())
    assert torch.equal(draft.q_draft[0], q[0]) and torch.equal(draft.q_draft[2], q[2])


def test_free_drafts_are_the_forced_run_alone():
    grammar = SlotGrammar(20, [{1, 2}, 7, 8, {3, 4}], stop=0)
    wrapper = GrammarDrafter(FixedDrafter([9, 9]), grammar)
    assert wrapper.free_draft([1]) is None  # a choice first: nothing known
    grammar.accept(2)
    assert wrapper.free_draft([1]).tokens.tolist() == [7, 8] and grammar.accepted == [2]


def test_the_wrapper_passes_trees_and_the_drafters_verbs_through():
    grammar = ModGrammar(10)
    tree = Draft(torch.tensor([2, 2]), None, parents=[-1, -1])

    class Tree(FixedDrafter):
        def propose(self, sequence, num_draft_tokens, params, generator):
            return tree

    assert GrammarDrafter(Tree([1]), grammar).propose([1], 2, GREEDY, None) is tree
    inner = FixedDrafter([1, 2])
    wrapper = GrammarDrafter(inner, grammar)
    assert wrapper.name == inner.name and wrapper.hidden_layers == inner.hidden_layers
    assert wrapper.max_draft_tokens > inner.max_draft_tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_constrained_run_with_forced_drafts_equals_plain(engine, adaptive):  # noqa: F811
    """The batch engine wraps the request's drafter (RequestConstraint.guide); drafts that are forced, cut or
    wrong leave greedy output as constrained plain decoding's."""
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    vocab = engine.target.config.vocab_size
    slots = [{1, 3, 5, 7, 9}, 4, 6, {10, 11, 12}, 8, 2, 4, set(range(13, 40)), 3, 5] * 3

    def run(drafter, k):
        batch = BatchEngine(engine, BatchConfig(num_blocks=32, block_size=8, adaptive_drafts=adaptive),
                            {} if drafter is None else {"d": drafter})
        constraint = RequestConstraint(SlotGrammar(vocab, slots, stop=0), vocab)
        request = BatchRequest(prompt, 20, drafter="d" if k else "none", num_draft_tokens=k, constraint=constraint)
        result = run_to_completion(batch, [request])[0]
        return result.token_ids, result.stats

    plain, _ = run(None, 0)
    assert SlotGrammar(vocab, slots, 0).accepted == [] and all(
        t == s if isinstance(s, int) else t in s for t, s in zip(plain, slots))
    for drafter in (lambda: ReplayDrafter(prompt, plain, 3), lambda: FixedDrafter([1, 2, 3])):
        tokens, stats = run(drafter, 3)
        assert tokens == plain
        assert stats.target_forwards < len(plain) / 2  # forced runs are drafted (free where no drafts are granted)
