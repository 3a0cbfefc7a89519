"""Continuous batching on SmolLM2 (fp32): every request of a mixed batch equals its single-request result."""

from __future__ import annotations

import pytest

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from tests.e2e.conftest import SMOLLM2, lean_engine

PROMPTS = [
    "Write a Python function that returns the sum of a list.",
    "List the first five prime numbers, then repeat the list.",
    "Count from one to ten in words.",
]


@pytest.mark.model
def test_batched_greedy_equals_plain_single_requests_smollm2():
    engine = lean_engine(SMOLLM2, "fp32")
    batch = BatchEngine(engine, BatchConfig(num_blocks=128, block_size=16, adaptive_drafts=False), request_drafters(engine))
    draft_lengths = [0, 3, 8]
    requests = [BatchRequest(engine.encode_prompt(p), 16, drafter="ngram", num_draft_tokens=k)
                for p, k in zip(PROMPTS, draft_lengths)]
    results = run_to_completion(batch, requests, join_every=2)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == engine.generate(prompt, max_new_tokens=16).token_ids, prompt
    assert batch.pool.blocks_used == 0
