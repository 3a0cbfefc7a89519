"""The shipped DFlash drafter for SmolLM2 (scripts/train_smollm2_dflash.sh): lossless, and its drafts are accepted.

It was trained on only 96 regenerated sequences for 150 steps (held-out tau 1.13): the test checks that trained
weights carry real signal (an untrained drafter's first-position acceptance is ~0 over a 49152-token vocabulary).
"""

from __future__ import annotations

import pytest

from dflash2.drafters import build_drafter, shipped_dflash_drafter
from tests.e2e.conftest import SMOLLM2, lean_engine

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
]


@pytest.mark.model
def test_shipped_smollm2_drafter_is_lossless_and_accepted():
    engine = lean_engine(SMOLLM2, "fp32")
    assert (shipped_dflash_drafter(SMOLLM2) / "model.safetensors").exists()
    drafter = build_drafter("dflash", engine)  # no flags: the shipped drafter
    first_position = []
    for prompt in PROMPTS:
        plain = engine.generate(prompt, max_new_tokens=64)
        engine.drafter = drafter
        try:
            spec = engine.generate(prompt, max_new_tokens=64)
        finally:
            engine.drafter = None
        assert spec.token_ids == plain.token_ids
        assert spec.stats.tau > 1.0
        first_position.append(spec.stats.acceptance_by_position[0])
    assert sum(first_position) / len(first_position) > 0.03  # measured 0.07 on these prompts
