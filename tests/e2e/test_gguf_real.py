"""--weights gguf on SmolLM2 (its GGUF: Q4_1 projections, a Q8_0 tied head): the layers are the file's blocks,
a verification block's logits are bitwise the single steps', greedy speculation reproduces plain decoding, and the
logits stay close to the bf16 conversion of the same file."""

from __future__ import annotations

import functools

import pytest
import torch

import dflash2
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels.gguf_linear import GgufLinear
from dflash2.models.loading import load_transformer
from tests.e2e.conftest import SMOLLM2, model_dir
from tests.e2e.test_speculative_real import CODE_PROMPT, generate_with

NEW_TOKENS = 48


@functools.lru_cache(maxsize=1)
def gguf_engine():
    return dflash2.load(SMOLLM2, drafter="none", dtype="fp32", weights="gguf", device="cpu")


@pytest.mark.model
def test_smollm2_gguf_layers_are_the_files_blocks():
    model = gguf_engine().target
    assert isinstance(model.lm_head, GgufLinear) and [p.qtype for p in model.lm_head.parts] == ["Q8_0"]
    assert [p.qtype for p in model.layers[0].attn.wqkv.parts] == ["Q4_1"]


@pytest.mark.model
@torch.inference_mode()
def test_smollm2_gguf_verification_block_equals_single_steps():
    model = gguf_engine().target
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(64)
    model(ids[:, :15], cache=cache, logits="none")
    block = model(ids[:, 15:], cache=cache, logits="all").logits  # 9 rows
    cache.rollback(15)
    steps = torch.cat([model(ids[:, i : i + 1], cache=cache, logits="all").logits for i in range(15, 24)], dim=1)
    assert torch.equal(block, steps)


@pytest.mark.model
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)])
def test_smollm2_gguf_speculation_is_lossless(k):
    engine = gguf_engine()
    plain = engine.generate(CODE_PROMPT, max_new_tokens=NEW_TOKENS)
    ngram = generate_with(engine, NgramDrafter(k, stop_ids=engine.tokenizer.eos_token_ids), CODE_PROMPT,
                          max_new_tokens=NEW_TOKENS)
    assert ngram.token_ids == plain.token_ids


@pytest.mark.model
@torch.inference_mode()
def test_smollm2_gguf_logits_close_to_the_bf16_conversion():
    gguf = gguf_engine().target
    reference = load_transformer(model_dir(SMOLLM2, "fp32"), "fp32", "cpu")  # the file dequantized, fp32
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(1))
    a = gguf(ids, cache=gguf.new_cache(40), logits="all").logits[0]
    b = reference(ids, cache=reference.new_cache(40), logits="all").logits[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert (a - b).abs().max() < 0.1 * b.abs().max()


@pytest.mark.model
@pytest.mark.qwen
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["auto", "dflash2+ngram"])
def test_qwen_gguf_default_drafters_give_plain_tokens(drafter):
    """The default target on its Q4_K_M blocks with `auto` (pard+ngram: the PARD drafter in q4_0 or int8, no GGUF
    holds its merged weights) and with `dflash2+ngram`, the server's default off AMX tiles (the DFlash2 drafter over a
    draft vocabulary, whose head is the target head's rows as they are: GgufLinear.select_rows), gives plain gguf
    decoding's tokens."""
    from tests.e2e.conftest import QWEN_TARGET, lean_engine

    lean_engine.cache_clear()
    engine = dflash2.load(QWEN_TARGET, drafter=drafter, dtype="bf16", weights="gguf", device="cpu")
    drafter, engine.drafter = engine.drafter, None
    plain = engine.generate(CODE_PROMPT, max_new_tokens=32)
    engine.drafter = drafter
    speculative = engine.generate(CODE_PROMPT, max_new_tokens=32)
    assert speculative.token_ids == plain.token_ids
    assert speculative.stats.tau > 1.0
