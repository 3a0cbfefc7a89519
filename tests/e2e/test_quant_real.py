"""int8 weights on SmolLM2: greedy speculation (n-gram and model drafters) reproduces plain greedy decoding of the
int8 target token for token; the command line and the API take --weights / weights=."""

from __future__ import annotations

import functools
import json

import pytest

import dflash2
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels.quant_linear import QuantLinear
from dflash2.models.loading import load_transformer
from tests.e2e.conftest import SMOLLM2, model_dir
from tests.e2e.test_cli import dflash2 as run_cli
from tests.e2e.test_speculative_real import CODE_PROMPT, generate_with

NEW_TOKENS = 64


@functools.lru_cache(maxsize=1)
def int8_engine():
    """SmolLM2 with int8 weights and fp32 activations (fp32 attention: exact identity is expected)."""
    return dflash2.load(SMOLLM2, drafter="none", dtype="fp32", weights="int8", device="cpu")


@functools.lru_cache(maxsize=1)
def int8_plain():
    return int8_engine().generate(CODE_PROMPT, max_new_tokens=NEW_TOKENS)


@pytest.mark.model
@pytest.mark.parametrize("k", [1, 4, 8, 15])
def test_smollm2_int8_speculation_is_lossless_with_respect_to_the_int8_target(k):
    engine = int8_engine()
    assert isinstance(engine.target.lm_head, QuantLinear)
    plain = int8_plain()
    ngram = generate_with(engine, NgramDrafter(k, stop_ids=engine.tokenizer.eos_token_ids), CODE_PROMPT,
                          max_new_tokens=NEW_TOKENS)
    itself = generate_with(engine, ModelDrafter(engine.target, k), CODE_PROMPT, max_new_tokens=NEW_TOKENS)
    assert ngram.token_ids == plain.token_ids
    assert itself.token_ids == plain.token_ids
    assert itself.stats.accepted_by_position == itself.stats.drafted_by_position


@pytest.mark.model
def test_smollm2_int8_target_with_an_unquantized_draft_model_is_lossless():
    """A draft model that differs from the target (the fp32 original drafting for its int8 version)."""
    engine = int8_engine()
    draft = load_transformer(model_dir(SMOLLM2, "fp32"), "fp32")
    spec = generate_with(engine, ModelDrafter(draft, 4), CODE_PROMPT, max_new_tokens=NEW_TOKENS)
    assert spec.token_ids == int8_plain().token_ids
    assert spec.stats.tau > 1.5  # the fp32 original agrees with its int8 version on most tokens


@pytest.mark.model
def test_cli_generate_with_int8_weights():
    proc = run_cli("generate", "Say hello.", "--model", SMOLLM2, "--weights", "int8", "--drafter", "model",
                   "--draft-model", SMOLLM2, "--max-new-tokens", "8", "--json", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["new_tokens"] > 0 and result["text"]


def test_cli_rejects_an_unknown_weight_format():
    proc = run_cli("generate", "hi", "--weights", "int3")
    assert proc.returncode == 2 and "invalid choice: 'int3'" in proc.stderr
