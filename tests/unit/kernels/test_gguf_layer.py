"""One C++ call per decoder layer over GGUF blocks (kernels/gguf_layer.py, gguf_layer.h): bit for bit the Python
layer's output and cache writes, for prefill, single steps and verification blocks, in fp32 and bf16, and only where
the Python layer would run exactly those kernels."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.stats import DecodeStats
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels import gguf_linear as gl
from dflash2.kernels.gguf_layer import ENV, fused_layers
from dflash2.models.decoder import CachedAttention
from dflash2.models.loading import load_transformer
from dflash2.platform import reload_settings
from tests.unit.kernels.test_gguf_blocks import KERNELS
from tests.unit.decode.test_speculative_greedy import NEW_TOKENS, RandomDrafter, plain_ids, repetitive_prompt, spec_ids


def gguf_model(directory: str, dtype: str, backend: str):
    """A tiny model whose projections and head are Q8_0 blocks on ``backend`` (what a GGUF target runs)."""
    model = load_transformer(directory, dtype, packed=False)
    for layer in model.layers:
        for owner, name in ((layer.attn, "wqkv"), (layer.attn, "wo"), (layer.ffn, "w_gate_up"),
                            (layer.ffn, "w_down")):
            setattr(owner, name, gl.GgufLinear.from_linear(getattr(owner, name), backend))
    model.lm_head = gl.GgufLinear.from_linear(model.lm_head, backend)
    return model


def forward_pair(model, monkeypatch, chunks: list[int], taps=(0, 2)):
    """Logits, taps and cache contents of a sequence fed in chunks, through the fused layers and the Python ones."""
    ids = torch.randint(0, 256, (1, sum(chunks)), generator=torch.Generator().manual_seed(3))
    results = []
    for switch in ("on", "off"):
        monkeypatch.setenv(ENV, switch)
        reload_settings()
        cache, outs, start = model.new_cache(64), [], 0
        with torch.inference_mode():
            for n in chunks:
                out = model(ids[:, start:start + n], cache=cache, logits="all", hidden_layers=taps)
                outs.append((out.logits, *out.hidden_states))
                start += n
        results.append((outs, cache.keys[:, :, :, :start].clone(), cache.values[:, :, :, :start].clone()))
    return results


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_fused_layers_equal_the_python_layers_bitwise(tiny_model_dirs, monkeypatch, backend, dtype, key):
    model = gguf_model(tiny_model_dirs[key], dtype, backend)
    # prefill (causal without a mask), single steps, a verification block over a cache (causal mask), again steps
    (fused, keys, values), (python, keys_ref, values_ref) = forward_pair(model, monkeypatch, [12, 1, 1, 5, 1, 9])
    for got, expected in zip(fused, python):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(keys, keys_ref) and torch.equal(values, values_ref)


@pytest.mark.parametrize("backend", KERNELS)
def test_fused_layers_run_only_where_the_python_layer_takes_the_same_kernels(tiny_model_dirs, monkeypatch, backend):
    model = gguf_model(tiny_model_dirs["qwen2"], "bf16", backend)
    x = torch.zeros(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    cache = model.new_cache(16)
    monkeypatch.delenv(ENV, raising=False)
    reload_settings()
    with torch.inference_mode():
        assert fused_layers(model, CachedAttention(cache, None), x) is not None
        assert fused_layers(model, CachedAttention(cache, torch.ones(1, 1, 3, 3, dtype=torch.bool)), x) is None  # tree
        assert fused_layers(model, CachedAttention(None, None), x) is None  # no cache
        assert fused_layers(model, CachedAttention(cache, None), x.half()) is None
        monkeypatch.setenv("DFLASH2_ATTENTION", "torch")
        reload_settings()
        assert fused_layers(model, CachedAttention(cache, None), x) is None
        monkeypatch.delenv("DFLASH2_ATTENTION")
        monkeypatch.setenv(ENV, "off")
        reload_settings()
        assert fused_layers(model, CachedAttention(cache, None), x) is None
    monkeypatch.delenv(ENV)
    reload_settings()
    assert fused_layers(load_transformer(tiny_model_dirs["qwen2"], "bf16"), CachedAttention(cache, None), x) is None


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("k", [1, 4])
def test_speculation_stays_lossless_with_fused_layers(tiny_model_dirs, monkeypatch, backend, k):
    monkeypatch.delenv(ENV, raising=False)
    reload_settings()
    target = gguf_model(tiny_model_dirs["qwen2"], "bf16", backend)
    prompt = repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + k + 1
    expected = plain_ids(target, prompt, capacity)
    stats = DecodeStats()
    assert spec_ids(target, NgramDrafter(k), prompt, capacity, stats=stats) == expected
    assert spec_ids(target, RandomDrafter(k), prompt, capacity) == expected
    monkeypatch.setenv(ENV, "off")
    reload_settings()
    assert plain_ids(target, prompt, capacity) == expected  # the Python layers: the same tokens
