"""bf16 on the real Qwen2.5-Coder-1.5B: a verification block computes every token's logits bitwise like plain
one-token decoding, so every drafter, tree, pipeline and weight format gives plain greedy decoding's tokens
(docs/attention.md). The prompt is MT-bench question 81 (its bench output in bf16 with PyTorch's attention is the
kind that drifted from plain output at near-ties); 32 new tokens keep the file quick."""

from __future__ import annotations

import functools
import gc

import pytest
import torch

from dflash2.bench.datasets import load_suite
from dflash2.drafters import build_drafter
from dflash2.drafters.model import ModelDrafter
from tests.e2e.conftest import QWEN_TARGET, lean_engine

pytestmark = [pytest.mark.model, pytest.mark.qwen]

PROMPT_ID = "81"
NEW_TOKENS = 32


@functools.lru_cache(maxsize=1)
def prompt_text() -> str:
    return next(p.text for p in load_suite("mt_bench") if p.prompt_id == PROMPT_ID)


def engine(weights: str):
    return lean_engine(QWEN_TARGET, "bf16") if weights == "bf16" else int8_engine()


@functools.lru_cache(maxsize=1)
def int8_engine():
    import dflash2

    lean_engine.cache_clear()  # one 1.5B target in memory at a time
    plain_ids.cache_clear()
    gc.collect()
    return dflash2.load(QWEN_TARGET, drafter="none", dtype="bf16", device="cpu", weights="int8")


@functools.lru_cache(maxsize=None)
def plain_ids(weights: str) -> list[int]:
    return engine(weights).generate(prompt_text(), max_new_tokens=NEW_TOKENS).token_ids


def drafted_ids(weights: str, spec: str, pipeline: str = "sync") -> list[int]:
    target = engine(weights)
    drafter = ModelDrafter(target.target, 3) if spec == "itself:3" else build_drafter(spec, target)
    target.drafter, target.pipeline = drafter, pipeline
    try:
        return target.generate(prompt_text(), max_new_tokens=NEW_TOKENS).token_ids
    finally:
        target.drafter, target.pipeline = None, "sync"


def test_verification_blocks_give_plain_decodings_logits_bitwise() -> None:
    """Plain decoding's logits for 24 tokens, then the same tokens verified in blocks of 3 and of 8 (a pending token
    and its drafts, all accepted; the last block shorter): every logit bitwise equal. Equal logits mean equal argmax,
    so any drafter gives plain decoding's tokens; with PyTorch's attention this fails."""
    target = engine("bf16")
    model, ids, steps = target.target, target.encode_prompt(prompt_text()), 24
    cache = model.new_cache(len(ids) + steps)
    with torch.inference_mode():
        last = model(torch.tensor([ids]), cache=cache, logits="last").logits[0, -1]  # [V]
        tokens, plain = [], []
        for _ in range(steps):
            tokens.append(int(last.argmax()))
            last = model(torch.tensor([tokens[-1:]]), cache=cache).logits[0, -1]
            plain.append(last)
        for rows in (3, 8):
            cache.rollback(len(ids))
            blocks = [model(torch.tensor([tokens[s : s + rows]]), cache=cache).logits[0] for s in range(0, steps, rows)]
            assert torch.equal(torch.cat(blocks), torch.stack(plain)), f"blocks of {rows}"


def _slow(*specs: str) -> list:
    """The default run keeps one chain and one tree; the rest (a 1.5B bf16 decode each) run under -m slow."""
    return [pytest.param(spec, marks=pytest.mark.slow) for spec in specs]


@pytest.mark.parametrize("spec", ["ngram", "dflash2:2x3", *_slow("itself:3", "ngram:4x3", "model", "dflash",
                                                                  "dflash2", "auto", "pard:1+4x3")])
def test_every_drafter_gives_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("bf16", spec) == plain_ids("bf16")


@pytest.mark.parametrize("spec", ["dflash2:2x3", *_slow("model")])
def test_the_overlap_pipeline_gives_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("bf16", spec, pipeline="overlap") == plain_ids("bf16")


@pytest.mark.parametrize("spec", _slow("ngram", "dflash2"))
def test_int8_weights_give_their_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("int8", spec) == plain_ids("int8")


COMPANIONS = [
    "Write a Python function that merges two sorted lists.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?",
    "Give three tips for staying focused while studying.",
]


def _batch_ids(requests: list) -> list[list[int]]:
    from dflash2.decode.batch import BatchConfig, BatchEngine, request_drafters, run_to_completion

    target = engine("bf16")
    batch = BatchEngine(target, BatchConfig(num_blocks=64, block_size=16, adaptive_drafts=False),
                        request_drafters(target))
    return [result.token_ids for result in run_to_completion(batch, requests, join_every=1)]


@pytest.mark.parametrize("temperature", [0.0, pytest.param(0.8, marks=pytest.mark.slow)], ids=["greedy", "seeded-sampling"])
def test_a_request_in_the_server_batch_gives_its_tokens_alone(temperature) -> None:
    """The server's batch engine in bf16: a request drafted by n-gram lookup gives the same tokens alone and in a
    crowd of three other prompts joining one step apart (different lengths, so the ragged rows, padding and paged
    layouts differ); greedy, it also gives plain decoding's tokens."""
    from dflash2.decode.batch import BatchRequest
    from dflash2.verify import SamplingParams

    target = engine("bf16")
    params = SamplingParams(temperature=temperature, seed=11)
    request = BatchRequest(target.encode_prompt(prompt_text()), NEW_TOKENS, params=params, drafter="ngram",
                           num_draft_tokens=4)
    crowd = [BatchRequest(target.encode_prompt(text), NEW_TOKENS, params=SamplingParams(temperature=1.0, seed=i),
                          drafter="ngram" if i % 2 else "none", num_draft_tokens=3 if i % 2 else 0)
             for i, text in enumerate(COMPANIONS)]
    (alone,) = _batch_ids([request])
    crowded = _batch_ids(crowd[:1] + [request] + crowd[1:])[1]
    assert crowded == alone
    if temperature == 0.0:
        assert alone == plain_ids("bf16")
