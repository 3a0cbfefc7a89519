"""Constrained decoding at T > 0 through the batch engine: with a grammar, requests decoded with DFlash drafts
(sampled, q given), n-gram drafts and no drafts keep exactly the target's distribution renormalised over the
allowed tokens at every position (the mask applied before the warps, as plain constrained decoding applies it),
jointly and by position over their first four tokens (checks: tests/statistical/decode_paths.py). The drafts are
shaped by the grammar on the way (drafters/grammar.py: forbidden sampled drafts replaced, forced tokens drafted,
here also forced guesses that are not the only allowed token).

The companion masks only the first row of a verify pass (the drafts' rows unmasked, as if the grammar state were
not walked along the draft) and must be caught with fewer requests.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchRequest, run_to_completion
from dflash2.serve.structured import RequestConstraint
from dflash2.verify import SamplingParams
from dflash2.verify.grammar import apply_bitmask, full_bitmask
from dflash2.verify.sampling import logits_to_probs
from tests.statistical.decode_paths import DEPTH, VOCAB, assert_caught, assert_lossless, tiny_target
from tests.statistical.test_batch_distribution import batch_engine
from tests.unit.verify.test_grammar_constraint import ModGrammar

REQUESTS = 1200
BROKEN_REQUESTS = 300
PROMPTS = {(1, 2, 3): SamplingParams(temperature=0.9), (5, 0, 4, 2, 1, 2, 4): SamplingParams(temperature=1.3)}
DRAFTERS = ("dflash", "ngram", "none")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("vocab6-grammar-target"))


def masked(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
    """logits [V] after ``prefix`` generated tokens, with the grammar's forbidden tokens at -inf."""
    grammar = ModGrammar(VOCAB)
    assert all(grammar.accept(t) for t in prefix)
    mask = full_bitmask(1, VOCAB)
    grammar.fill_mask(mask[0])
    return apply_bitmask(logits[None], mask)[0]


@torch.inference_mode()
def exact_constrained_joint(target, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[VOCAB] * DEPTH float64: P(first DEPTH tokens) of plain constrained decoding, enumerated over the prefixes
    the grammar allows (the others have probability 0)."""
    joint = torch.zeros([VOCAB] * DEPTH, dtype=torch.float64)

    def walk(prefix: list[int], mass: float) -> None:
        if len(prefix) == DEPTH:
            joint[tuple(prefix)] = mass
            return
        logits = target(torch.tensor([prompt + prefix])).logits[0, -1]  # [V]
        p = logits_to_probs(masked(prefix, logits), params).double()  # [V]
        for token in range(VOCAB):
            if p[token] > 0:
                walk(prefix + [token], mass * float(p[token]))

    walk([], 1.0)
    return joint


class RowZeroOnly(RequestConstraint):
    """BROKEN: masks the first row of a pass only; the drafts' rows see the unmasked target."""

    def constrain(self, draft, logits):
        out = super().constrain(draft, logits)
        return torch.cat([out[:1], logits[1:]])

    def advance(self, emitted):
        for token in emitted:  # follows whatever was emitted (the broken rule may emit forbidden tokens)
            if not self.grammar.accept(token):
                self.grammar.accepted.append(token)


class GuessingGrammar(ModGrammar):
    """ModGrammar that names a "forced" token after every odd number of tokens: its least allowed one, though others
    are allowed too (a wrong jump-forward guess). The drafts then mix forced tokens (one-hot rows) with the drafter's
    own tokens and its replaced forbidden ones (drafters/grammar.py); the distribution must not move."""

    def forced_tokens(self) -> list[int]:
        if len(self.accepted) % 2 == 0:
            return []
        return [next(t for t in range(self.vocab) if self.allowed(t))]


def constrained_samples(target, count: int, constraint_type=RequestConstraint, grammar_type=ModGrammar
                        ) -> dict[tuple[int, ...], torch.Tensor]:
    prompts = list(PROMPTS)
    requests = []
    for index in range(count):
        prompt = prompts[index % len(prompts)]
        drafter = DRAFTERS[(index // len(prompts)) % len(DRAFTERS)]
        warp = PROMPTS[prompt]
        requests.append(BatchRequest(list(prompt), DEPTH, SamplingParams(temperature=warp.temperature, seed=index),
                                     drafter=drafter, num_draft_tokens=0 if drafter == "none" else 3,
                                     constraint=constraint_type(grammar_type(VOCAB), VOCAB)))
    results = run_to_completion(batch_engine(target), requests)
    out: dict[tuple[int, ...], list[list[int]]] = {prompt: [] for prompt in prompts}
    for request, result in zip(requests, results):
        out[tuple(request.prompt_ids)].append(result.token_ids)
    return {prompt: torch.tensor(rows) for prompt, rows in out.items()}


def test_constrained_requests_have_the_masked_target_distribution(target):
    for prompt, samples in constrained_samples(target, REQUESTS).items():
        assert_lossless(samples, exact_constrained_joint(target, list(prompt), PROMPTS[prompt]))


def test_forced_drafts_keep_the_masked_target_distribution(target):
    for prompt, samples in constrained_samples(target, REQUESTS, grammar_type=GuessingGrammar).items():
        assert_lossless(samples, exact_constrained_joint(target, list(prompt), PROMPTS[prompt]))


def test_masking_only_the_first_row_is_caught(target):
    for prompt, samples in constrained_samples(target, BROKEN_REQUESTS, RowZeroOnly).items():
        assert_caught(samples, exact_constrained_joint(target, list(prompt), PROMPTS[prompt]))
