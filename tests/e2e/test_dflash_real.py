"""The shipped DFlash drafters (SmolLM2: scripts/train/train_smollm2_dflash.sh; the Qwen target:
scripts/train/train_qwen_dflash.sh): lossless, and their drafts are accepted.

The SmolLM2 drafter was trained on only 192 regenerated sequences for 600 steps (held-out tau 1.46): the test checks
that trained weights carry real signal (an untrained drafter's first-position acceptance is ~0 over a 49152-token vocabulary).
"""

from __future__ import annotations

import functools

import pytest

from dflash2.drafters import build_drafter, shipped_dflash_drafter
from tests.e2e.conftest import QWEN_TARGET, SMOLLM2, lean_engine

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@functools.lru_cache(maxsize=None)
def plain_result(name: str, prompt: str, max_new_tokens: int):
    """Plain greedy decoding in fp32, once per (model, prompt, length) for every drafter compared with it."""
    return lean_engine(name, "fp32").generate(prompt, max_new_tokens=max_new_tokens)


def plain_and_drafted(engine, drafter, prompt: str, max_new_tokens: int):
    """(plain greedy result, result with ``drafter``) for one prompt (``engine``: a cached fp32 engine)."""
    plain = plain_result(engine.name, prompt, max_new_tokens)
    engine.drafter = drafter
    try:
        return plain, engine.generate(prompt, max_new_tokens=max_new_tokens)
    finally:
        engine.drafter = None


@pytest.mark.model
def test_shipped_smollm2_drafter_is_lossless_and_accepted():
    engine = lean_engine(SMOLLM2, "fp32")
    assert (shipped_dflash_drafter(SMOLLM2) / "model.safetensors").exists()
    drafter = build_drafter("dflash", engine)  # no flags: the shipped drafter
    first_position = []
    for prompt in PROMPTS:
        plain, spec = plain_and_drafted(engine, drafter, prompt, 64)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.tau > 1.0
        first_position.append(spec.stats.acceptance_by_position[0])
    assert sum(first_position) / len(first_position) > 0.03  # measured 0.07 on these prompts


@pytest.mark.qwen
# with `make test-all`: the first-generation DFlash drafter (no longer any default; ~80 s of the default run) and
# DFlash2's tree in fp32 (~46 s on the AMD EPYC Zen 3; the default run verifies that tree with the same drafter in
# bf16: test_identity_bf16's dflash2:2x3)
@pytest.mark.parametrize("kind,paths", [pytest.param("dflash", 1, marks=pytest.mark.slow), ("dflash2", 1),
                                        pytest.param("dflash2", 3, marks=pytest.mark.slow)],
                         ids=["dflash", "dflash2", "dflash2-tree"])
def test_shipped_qwen_drafter_is_lossless_and_accepted(kind, paths):
    """The default target's drafters, loaded with no flags, in fp32: plain greedy ids, and real acceptance (held-out
    tau 1.89 for DFlash, 1.99 for DFlash2 after training; an untrained drafter is ~1.0). ``paths`` 3: the best
    three selector paths verified as a tree."""
    engine = lean_engine(QWEN_TARGET, "fp32")
    drafter = build_drafter(kind, engine, num_candidates=paths)
    plain, spec = plain_and_drafted(engine, drafter, PROMPTS[1], 48)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.tau > 1.2 and spec.stats.acceptance_by_position[0] > 0.2
