"""Real models from the model store (pulled on first use; CI pulls SmolLM2 and the Qwen pair)."""

from __future__ import annotations

import functools

import pytest

SMOLLM2 = "smollm2-135m-instruct"
QWEN_TARGET = "qwen2.5-coder-1.5b-instruct"
QWEN_DRAFT = "qwen2.5-coder-0.5b-instruct"

MODEL_PARAMS = [
    pytest.param(SMOLLM2, marks=pytest.mark.model, id="smollm2"),
    pytest.param(QWEN_DRAFT, marks=[pytest.mark.model, pytest.mark.qwen], id="qwen-0.5b"),
    pytest.param(QWEN_TARGET, marks=[pytest.mark.model, pytest.mark.qwen], id="qwen-1.5b"),
]


@functools.lru_cache(maxsize=None)
def model_dir(name: str, dtype: str):
    from dflash2.models.store import resolve_model

    return resolve_model(name, dtype)


@functools.lru_cache(maxsize=2)
def lean_engine(name: str, dtype: str):
    """A cached engine (plain decoding); tests set ``engine.drafter`` themselves and reset it. Two at most (the
    fp32 1.5B is 6.2 GB); the oracle test empties the cache before it loads transformers' copy."""
    import dflash2

    return dflash2.load(name, drafter="none", dtype=dtype, device="cpu")
