"""Grammar masks along drafts (verify/grammar.py) and constrained decoding in the batch engine: constrained
speculative output equals constrained plain output token for token (greedy), for chains, trees and drafts the
grammar forbids; every emitted token obeys the grammar; the grammar state is back where it was after a pass."""

from __future__ import annotations

import random

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, run_to_completion
from dflash2.decode.engine import Engine
from dflash2.drafters.base import Draft, Drafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.loading import load_transformer
from dflash2.serve.structured import RequestConstraint
from dflash2.verify import SamplingParams
from dflash2.verify.grammar import apply_bitmask, decided_rows, draft_masks, full_bitmask, unpack_bitmask
from tests.unit.serve.test_serve_app import NoEosTokenizer


class ModGrammar:
    """A toy grammar over ids: the first token is odd; then t may follow l iff t != l and (l + t) % modulus != 0; after
    ``length`` tokens only ``stop`` may follow, which ends it."""

    def __init__(self, vocab: int, modulus: int = 3, length: int = 1000, stop: int | None = None) -> None:
        self.vocab, self.modulus, self.length, self.stop = vocab, modulus, length, stop
        self.accepted: list[int] = []

    def allowed(self, token: int) -> bool:
        if self.terminated():
            return False
        if len(self.accepted) >= self.length:
            return token == self.stop
        if token == self.stop:
            return False
        if not self.accepted:
            return token % 2 == 1
        return token != self.accepted[-1] and (self.accepted[-1] + token) % self.modulus != 0

    def fill_mask(self, out: torch.Tensor) -> None:
        allowed = torch.tensor([self.allowed(t) for t in range(self.vocab)] + [False] * (len(out) * 32 - self.vocab))
        weights = 2 ** torch.arange(32, dtype=torch.int64)
        words = (allowed.view(-1, 32).long() * weights).sum(-1)  # [W] as unsigned 32-bit values
        out.copy_(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))

    def accept(self, token: int) -> bool:
        if not self.allowed(token):
            return False
        self.accepted.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def terminated(self) -> bool:
        return self.stop is not None and bool(self.accepted) and self.accepted[-1] == self.stop


def mask_now(grammar: ModGrammar, vocab: int) -> torch.Tensor:
    out = full_bitmask(1, vocab)
    grammar.fill_mask(out[0])
    return out[0]


def test_bitmask_round_trip_and_apply():
    grammar = ModGrammar(70)
    grammar.accept(5)
    allowed = unpack_bitmask(mask_now(grammar, 70)[None], 70)[0]
    assert allowed.tolist() == [t != 5 and (5 + t) % 3 != 0 for t in range(70)]
    logits = torch.randn(1, 75)  # wider than the grammar's vocabulary: the padding columns are forbidden
    masked = apply_bitmask(logits, mask_now(grammar, 70)[None])
    assert torch.isinf(masked[0, 70:]).all() and torch.equal(masked[0, :70][allowed], logits[0, :70][allowed])
    assert torch.isinf(masked[0, :70][~allowed]).all()


@pytest.mark.parametrize("seed", range(20))
def test_draft_masks_equal_the_masks_after_each_path(seed):
    """Every reachable row's mask is the grammar's after the committed tokens and that row's draft path, chain
    or tree (sibling branches walked in any order); the state is left as it was."""
    rng = random.Random(seed)
    vocab = 40
    grammar = ModGrammar(vocab, length=rng.randint(2, 6), stop=0)
    for token in (1, 3):
        grammar.accept(token)
    n = rng.randint(0, 9)
    parents = None if seed % 2 else [rng.randint(-1, node - 1) for node in range(n)]
    draft = [rng.randrange(vocab) for _ in range(n)]
    masks = draft_masks(grammar, draft, parents, vocab)
    assert grammar.accepted == [1, 3]
    chain = list(range(-1, n - 1)) if parents is None else parents
    for row in range(n + 1):
        path, node = [], row - 1
        while node >= 0:
            path.append(draft[node])
            node = chain[node]
        fresh = ModGrammar(vocab, length=grammar.length, stop=0)
        if all(fresh.accept(t) for t in [1, 3, *path[::-1]]) and not fresh.terminated():
            assert torch.equal(masks[row], mask_now(fresh, vocab)), row
        else:
            assert (masks[row] == -1).all(), row  # unreachable: everything allowed, the warps stay defined


def test_decided_rows_follow_the_first_matching_child():
    parents = [-1, -1, 0, 0, 2]
    tokens = [7, 8, 9, 9, 4]
    assert decided_rows(tokens, parents, [7, 9, 4, 1]) == [0, 1, 3, 5]  # node 2 (first 9), then node 4
    assert decided_rows(tokens, parents, [8, 2]) == [0, 2]
    assert decided_rows(tokens, None, [1, 2, 3]) == [0, 1, 2]


class ReplayDrafter(Drafter):
    """Proposes a reference continuation (right drafts), every third one replaced by a token the grammar forbids
    after the previous draft (so verification must reject it)."""

    name = "replay"

    def __init__(self, prompt: list[int], reference: list[int], k: int) -> None:
        super().__init__(k)
        self.prompt, self.reference = prompt, reference

    def propose(self, sequence, num_draft_tokens, params, generator) -> Draft:
        done = len(sequence) - len(self.prompt)
        drafts = self.reference[done : done + num_draft_tokens]
        for i in range(2, len(drafts), 3):
            drafts[i] = drafts[i - 1]  # a repeat: forbidden
        return Draft(torch.tensor(drafts, dtype=torch.int64), None)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    return Engine(load_transformer(tiny_model_dirs["llama"], "fp32", "cpu"), NoEosTokenizer(), name="tiny")


def constrained_run(engine, prompt, drafter_factory, k, params=SamplingParams(), new=24) -> tuple[list[int], int]:
    vocab = engine.target.config.vocab_size
    drafters = {} if drafter_factory is None else {"d": drafter_factory}
    batch = BatchEngine(engine, BatchConfig(num_blocks=32, block_size=8, adaptive_drafts=False), drafters)
    constraint = RequestConstraint(ModGrammar(vocab), vocab)
    request = BatchRequest(prompt, new, params, drafter="d" if k else "none", num_draft_tokens=k,
                           constraint=constraint)
    result = run_to_completion(batch, [request])[0]
    # advanced by exactly the emitted tokens (the last pass may emit past the token limit)
    assert constraint.grammar.accepted[: len(result.token_ids)] == result.token_ids
    assert len(constraint.grammar.accepted) < len(result.token_ids) + max(k, 1) + 1
    return result.token_ids, sum(result.stats.accepted_by_position)


def obeys(tokens: list[int], vocab: int) -> bool:
    grammar = ModGrammar(vocab)
    return all(grammar.accept(t) for t in tokens)


@pytest.mark.parametrize("prompt", [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 6, 5, 4, 3, 2, 1]])
def test_constrained_speculative_equals_constrained_plain(engine, prompt):
    vocab = engine.target.config.vocab_size
    plain, _ = constrained_run(engine, prompt, None, 0)
    assert obeys(plain, vocab)
    unconstrained = run_to_completion(BatchEngine(engine, BatchConfig(num_blocks=32, block_size=8)),
                                      [BatchRequest(prompt, 24)])[0].token_ids
    assert unconstrained != plain  # the grammar changed the output
    replay, accepted = constrained_run(engine, prompt, lambda: ReplayDrafter(prompt, plain, 5), 5)
    assert replay == plain and accepted > 0
    for factory in (lambda: NgramDrafter(4, stop_ids=set()), lambda: NgramDrafter(3, num_candidates=3)):
        assert constrained_run(engine, prompt, factory, 4)[0] == plain
    # the unconstrained greedy continuation as drafts: what the target wants, often forbidden
    greedy, _ = constrained_run(engine, prompt, lambda: ReplayDrafter(prompt, unconstrained, 4), 4)
    assert greedy == plain


def test_sampled_constrained_requests_obey_the_grammar_and_repeat_by_seed(engine):
    prompt = [4, 5, 6, 4, 5, 6]
    vocab = engine.target.config.vocab_size
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [constrained_run(engine, prompt, factory, k, params)[0]
            for factory, k in ((None, 0), (lambda: NgramDrafter(4), 4))]
    assert all(obeys(run, vocab) for run in runs)
