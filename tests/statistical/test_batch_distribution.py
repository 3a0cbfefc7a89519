"""The batch engine (continuous batching, what the server runs) at T > 0: requests decoded together, with DFlash,
DFlash2 (selector over a draft vocabulary), n-gram and no drafts mixed in one ragged forward, keep exactly the
target's distribution of their first four tokens, jointly and by position (checks: tests/statistical/decode_paths.py).

Two prompts of different lengths with different warps share every batch; each request is seeded, so the test is
deterministic. The companions break one rule of the batch engine's verification and assert that the same checks
reject it with fewer requests.
"""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, run_to_completion
from dflash2.drafters.dflash import DFlashDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.verify import SamplingParams
from tests.statistical.decode_paths import (
    assert_caught,
    assert_lossless,
    broken,
    exact_joint,
    swap_p_and_q,
    tiny_drafter_model,
    tiny_engine,
    tiny_target,
    unwarped,
)

REQUESTS = 2000  # per test, both prompts together
SLOW_REQUESTS = 20_000
BROKEN_REQUESTS = 400
PROMPTS = {  # prompt -> the warps its requests use
    (1, 2, 3): SamplingParams(temperature=0.9, top_p=0.8),
    (5, 0, 4, 2, 1, 2, 4): SamplingParams(temperature=1.2, top_k=4),
}
DRAFTERS = ("dflash", "dflash2", "ngram", "none")  # cycled over the requests


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("vocab6-target"))


def batch_engine(target) -> BatchEngine:
    dflash = DFlashDrafter(tiny_drafter_model(target, seed=1), target, 3)
    dflash2 = DFlashDrafter(tiny_drafter_model(target, seed=2, selector=True, draft_vocab=True), target, 3)
    drafters = {"dflash": dflash.for_request, "dflash2": dflash2.for_request, "ngram": lambda: NgramDrafter(3)}
    config = BatchConfig(max_batch_size=32, num_blocks=160, block_size=8, max_queue=SLOW_REQUESTS,
                         queue_timeout_s=3600.0)
    return BatchEngine(tiny_engine(target, None), config, drafters)


def batched_samples(target, count: int) -> dict[tuple[int, ...], torch.Tensor]:
    """prompt -> [requests, 4] first tokens of ``count`` seeded requests, all run through one batch engine."""
    prompts = list(PROMPTS)
    requests = []
    for index in range(count):
        prompt = prompts[index % len(prompts)]
        drafter = DRAFTERS[(index // len(prompts)) % len(DRAFTERS)]
        params = SamplingParams(temperature=PROMPTS[prompt].temperature, top_k=PROMPTS[prompt].top_k,
                                top_p=PROMPTS[prompt].top_p, seed=index)
        requests.append(BatchRequest(list(prompt), 4, params=params, drafter=drafter,
                                     num_draft_tokens=0 if drafter == "none" else 3))
    results = run_to_completion(batch_engine(target), requests)
    out: dict[tuple[int, ...], list[list[int]]] = {prompt: [] for prompt in prompts}
    for request, result in zip(requests, results):
        out[tuple(request.prompt_ids)].append(result.token_ids)
    return {prompt: torch.tensor(rows) for prompt, rows in out.items()}


@pytest.mark.parametrize("count", [REQUESTS, pytest.param(SLOW_REQUESTS, marks=pytest.mark.slow)])
def test_batched_requests_have_the_target_distribution(target, count):
    for prompt, samples in batched_samples(target, count).items():
        assert_lossless(samples, exact_joint(target, list(prompt), PROMPTS[prompt]))


@pytest.mark.parametrize("attribute, replacement", [("verify_chain", swap_p_and_q), ("logits_to_probs", unwarped)],
                         ids=["p-q-swapped", "warps-not-applied"])
def test_a_broken_batch_rule_is_caught(target, attribute, replacement):
    with broken(attribute, replacement):
        samples = batched_samples(target, BROKEN_REQUESTS)
    for prompt, rows in samples.items():
        assert_caught(rows, exact_joint(target, list(prompt), PROMPTS[prompt]))
