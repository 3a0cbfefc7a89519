"""int8 / int4 weight-only models: loading swaps every projection and the head, the logits stay near the unquantized
model's, and greedy speculation is exactly lossless with respect to the quantized target (tiny random models)."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels.quant_linear import QuantLinear, default_quant_backend, quant_kernel_status, quant_kernels_available
from dflash2.models.loading import WEIGHT_FORMATS, check_weight_format, load_transformer, weight_format
from tests.unit.decode.test_speculative_greedy import NEW_TOKENS, RandomDrafter, plain_ids, repetitive_prompt, spec_ids

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason=f"int8 kernel unavailable: {quant_kernel_status()}")


@pytest.fixture(scope="module")
def quantized(tiny_model_dirs):
    """{(key, dtype, weights): quantized model} for the tiny Qwen2 (biases, untied head) and Llama (tied head)."""
    return {(key, dtype, weights): load_transformer(tiny_model_dirs[key], dtype, weights=weights)
            for key in ("qwen2", "llama", "qwen2_other") for dtype in ("fp32", "bf16") for weights in ("int8", "int4")}


def test_every_projection_and_the_head_are_quantized(quantized, tiny_model_dirs):
    model = quantized[("qwen2", "fp32", "int8")]
    linears = [model.lm_head] + [m for layer in model.layers for m in (layer.attn.wqkv, layer.attn.wo,
                                                                       layer.ffn.w_gate_up, layer.ffn.w_down)]
    assert all(isinstance(m, QuantLinear) and m.backend == default_quant_backend("int8") for m in linears)
    assert weight_format(model) == "int8" and model.embed.weight.dtype == torch.float32
    assert weight_format(quantized[("llama", "bf16", "int4")]) == "int4"
    assert weight_format(load_transformer(tiny_model_dirs["llama"], "bf16")) == "bf16"


@torch.inference_mode()
@pytest.mark.parametrize("weights,rel", [("int8", 0.05), ("int4", 0.5)])
@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_quantized_logits_stay_near_the_unquantized_model(quantized, tiny_model_dirs, key, weights, rel):
    reference = load_transformer(tiny_model_dirs[key], "fp32")
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    expected, got = reference(ids).logits, quantized[(key, "fp32", weights)](ids).logits
    error = (got - expected).abs().max()
    assert 0 < error < rel * expected.abs().max()  # quantized (not the same weights), but close


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 4, 8, 15])
def test_speculation_is_lossless_with_respect_to_the_quantized_target(quantized, dtype, k, weights):
    target = quantized[("qwen2", dtype, weights)]
    prompt = repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    expected = plain_ids(target, prompt, capacity)
    itself = DecodeStats()
    assert spec_ids(target, ModelDrafter(target, k), prompt, capacity, stats=itself) == expected
    assert itself.accepted_by_position == itself.drafted_by_position  # drafter == target: everything accepted
    assert spec_ids(target, NgramDrafter(k), prompt, capacity) == expected
    assert spec_ids(target, ModelDrafter(quantized[("qwen2_other", dtype, weights)], k), prompt, capacity) == expected
    assert spec_ids(target, RandomDrafter(k), prompt, capacity) == expected


def test_weight_format_checks():
    assert WEIGHT_FORMATS == ("bf16", "int8", "int4", "gguf")
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        check_weight_format("int3", "cpu")
    for quantized in ("int8", "int4", "gguf"):
        with pytest.raises(ValueError, match="CPU only"):
            check_weight_format(quantized, "cuda")
    check_weight_format("bf16", "cuda")
