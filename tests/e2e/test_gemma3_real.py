"""Gemma-3-270M (its Q4_K_M GGUF from the store): greedy speculation gives plain decoding's tokens in bf16 and on the
file's own blocks, past the 512-token sliding window; the converted model's logits are transformers' own loading of
the same GGUF. Skipped unless the model is pulled (`dflash2 models pull gemma-3-270m`, ~250 MB)."""

from __future__ import annotations

import functools

import pytest
import torch

import dflash2
from dflash2.drafters.ngram import NgramDrafter
from dflash2.models.store import gguf_path
from tests.e2e.test_speculative_real import generate_with

GEMMA3 = "gemma-3-270m"
NEW_TOKENS = 64
WINDOW = 512  # its sliding layers' window
FUNCTIONS = 18  # 466 prompt tokens: the answer crosses the window

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not gguf_path(GEMMA3).is_file(), reason=f"run `dflash2 models pull {GEMMA3}`")]


def long_prompt() -> str:
    """~500 tokens of code: the answer's tokens cross the window, and n-gram drafts find continuations in it."""
    functions = [f"def add_{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n    return x + {i}\n\n"
                 for i in range(FUNCTIONS)]
    return "".join(functions) + f"def add_{FUNCTIONS}(x):\n"


@functools.lru_cache(maxsize=2)
def engine(weights: str):
    return dflash2.load(GEMMA3, drafter="none", dtype="bf16", weights=weights, device="cpu")


@pytest.mark.parametrize("weights", ["bf16", "gguf"])
def test_gemma3_ngram_gives_plain_tokens_past_the_window(weights):
    model = engine(weights)
    prompt = long_prompt()
    prompt_tokens = len(model.encode_prompt(prompt))
    assert prompt_tokens < WINDOW < prompt_tokens + NEW_TOKENS
    plain = model.generate(prompt, max_new_tokens=NEW_TOKENS)
    ngram = generate_with(model, NgramDrafter(6, stop_ids=model.tokenizer.eos_token_ids), prompt,
                          max_new_tokens=NEW_TOKENS)
    assert ngram.token_ids == plain.token_ids
    assert ngram.stats.tau > 1.5  # the drafts were accepted: the comparison covered verification blocks
    assert f"return x + {FUNCTIONS}" in plain.text  # it continues the pattern: its BOS, norms and window are right


@pytest.mark.slow
@torch.inference_mode()
def test_gemma3_logits_match_transformers_reading_the_gguf():
    """transformers dequantizes the same file (~100 s): the fp32 conversion's logits agree past the window."""
    from transformers import AutoModelForCausalLM

    from dflash2.models.loading import load_transformer
    from tests.e2e.conftest import model_dir

    directory = model_dir(GEMMA3, "fp32")
    ids = torch.tensor([engine("bf16").encode_prompt(long_prompt() * 2)])[:, : WINDOW + 100]
    ours = load_transformer(directory, "fp32", "cpu")(ids).logits[0]
    gguf = gguf_path(GEMMA3)
    oracle = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    theirs = oracle(ids).logits[0]
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.99
    assert (ours - theirs).abs().max() < 0.05  # logits of magnitude ~40; 0.006 measured at 662 tokens
