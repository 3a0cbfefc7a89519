"""The model store on a real model: SmolLM2-135M-Instruct (one 98 MB chunk package).

Uses the session's store home (``$DFLASH2_HOME``, default ``~/.cache/dflash2``), so a cache that CI or a
developer already pulled is reused and only verified.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dflash2.models import store

pytestmark = pytest.mark.model

NAME = "smollm2-135m-instruct"
PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def pulled() -> dict:
    return store.pull("smollm2", dtypes=("fp32", "bf16"))


def test_pull_is_verified(pulled):
    gguf = store.gguf_path(NAME)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert digest == store.REGISTRY[NAME].sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    store.verify(NAME)
    assert store.resolve_model("smollm2", "fp32", pull=False) == pulled["fp32"]
    status = {s.name: s for s in store.list_models()}[NAME]
    assert status.pulled and {"fp32", "bf16"} <= set(status.converted)


def test_config_and_eos(pulled):
    config = json.loads((pulled["fp32"] / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["eos_token_id"] == 2 and config["max_position_embeddings"] == 8192
    generation = json.loads((pulled["fp32"] / "generation_config.json").read_text())
    assert generation["eos_token_id"][0] == 2


def test_chat_template_renders(pulled):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pulled["bf16"]))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> opens, two <|im_end|> close turns


def test_logits_match_transformers_gguf_loader(pulled):
    pytest.importorskip("accelerate")  # transformers refuses gguf_file= without it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pulled["fp32"]))
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])  # [1, seq]

    converted, info = AutoModelForCausalLM.from_pretrained(
        str(pulled["fp32"]), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    gguf = store.gguf_path(NAME)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        ours = converted.eval()(ids).logits  # [1, seq, vocab]
        theirs = reference.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)

    bf16 = AutoModelForCausalLM.from_pretrained(str(pulled["bf16"]), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        low = bf16(ids).logits.float()
    assert low[0, -1].argmax() == ours[0, -1].argmax()
    reply = tokenizer.decode([int(ours[0, -1].argmax())])
    assert reply.strip()  # a real token, not padding
