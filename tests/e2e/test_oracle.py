"""The lean decoder against transformers on the real models' weights, in fp32: logits and greedy tokens."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.e2e.conftest import MODEL_PARAMS, QWEN_TARGET, lean_engine, model_dir

PROMPT = "Write a Python function that checks whether a number is prime."
# Greedy tokens decoded by both sides. Each fp32 token of the 1.5B streams its 6.2 GB twice (the oracle and the lean
# engine): 24 of them test decoding from the cache at a third of 64's cost; SmolLM2 decodes the full 64.
NEW_TOKENS = {QWEN_TARGET: 24}


@pytest.mark.parametrize("name", MODEL_PARAMS)
@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(name):
    from transformers import AutoModelForCausalLM

    from dflash2.models.tokenizer import Tokenizer

    # The oracle runs first and is freed before the lean engine loads: two fp32 copies of the 1.5B (6.2 GB each)
    # never live together, which keeps the test run's peak memory within the machine.
    lean_engine.cache_clear()
    gc.collect()
    tokenizer = Tokenizer(model_dir(name, "fp32"))
    chat = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(chat) if tokenizer.has_chat_template else tokenizer.encode(PROMPT)
    prompt_ids = torch.tensor([ids])
    oracle = AutoModelForCausalLM.from_pretrained(str(model_dir(name, "fp32")), dtype=torch.float32).eval()
    expected_logits = oracle(prompt_ids).logits[0]  # [T, V]
    new_tokens = NEW_TOKENS.get(name, 64)
    generated = oracle.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False)
    expected = generated[0, prompt_ids.shape[1] :].tolist()
    del oracle
    gc.collect()

    engine = lean_engine(name, "fp32")
    assert engine.encode_prompt(PROMPT) == prompt_ids[0].tolist()
    lean_logits = engine.target(prompt_ids).logits[0]
    assert (lean_logits - expected_logits).abs().max().item() < 2e-3
    assert torch.equal(lean_logits.argmax(-1), expected_logits.argmax(-1))

    expected = [t for t in expected if t not in engine.tokenizer.eos_token_ids][:new_tokens]
    result = engine.generate(PROMPT, max_new_tokens=new_tokens)
    assert result.token_ids == expected
