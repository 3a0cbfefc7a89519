"""bf16 on the real Qwen2.5-Coder-1.5B: a verification block computes every token's logits bitwise like plain
one-token decoding, so every drafter, tree, pipeline and weight format gives plain greedy decoding's tokens
(docs/attention.md). The prompt is MT-bench question 81: with PyTorch's attention (``DFLASH2_ATTENTION=torch``) and
the target drafting for itself 3 tokens at a time, its output left plain decoding's at generated token 25 (k = 8: at
token 118); the generation tests stop a few tokens past 25 to keep the file quick."""

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


def test_a_verification_block_gives_the_logits_of_one_token_at_a_time() -> None:
    model = engine("bf16").target
    ids = engine("bf16").encode_prompt(prompt_text())
    block = [int(t) for t in ids[-9:]]  # 9 rows: a pending token and 8 drafts
    cache = model.new_cache(len(ids) + 1)
    with torch.inference_mode():
        model(torch.tensor([ids[:-9]]), cache=cache, logits="none")
        verified = model(torch.tensor([block]), cache=cache).logits[0]
        cache.rollback(len(ids) - 9)
        alone = torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in block])
    assert torch.equal(verified, alone)


@pytest.mark.parametrize("spec", ["itself:3", "ngram", "ngram:4x3", "model", "dflash", "dflash2", "dflash2:2x3",
                                  "auto"])
def test_every_drafter_gives_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("bf16", spec) == plain_ids("bf16")


@pytest.mark.parametrize("spec", ["model", "dflash2:2x3"])
def test_the_overlap_pipeline_gives_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("bf16", spec, pipeline="overlap") == plain_ids("bf16")


@pytest.mark.parametrize("spec", ["ngram", "dflash2"])
def test_int8_weights_give_their_plain_greedy_tokens(spec) -> None:
    assert drafted_ids("int8", spec) == plain_ids("int8")
