"""One C++ call per decoder layer over GGUF blocks (kernels/gguf_layer.py, gguf_layer.h): bit for bit the Python
layer's output and cache writes, for prefill, single steps, verification blocks and trees (an explicit mask), in fp32
and bf16, and only where the Python layer would run exactly those kernels."""

from __future__ import annotations

import pytest
import torch

from dflash2.decode.stats import DecodeStats
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels import gguf_linear as gl
from dflash2.kernels.gguf_layer import ENV, fused_layers
from dflash2.models import decoder
from dflash2.models.decoder import CachedAttention
from dflash2.models.loading import load_transformer
from dflash2.platform import reload_settings
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask
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
        tree = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
        assert fused_layers(model, CachedAttention(cache, tree), x) is not None  # a tree's mask: the kernel takes it
        assert fused_layers(model, CachedAttention(cache, tree[:, :, -1:]), x) is not None  # one row for all queries
        assert fused_layers(model, CachedAttention(cache, tree.float()), x) is None  # not bool: PyTorch's attention
        for shape in ((1, 1, 3, 4), (1, 2, 3, 3), (2, 1, 3, 3), (1, 3, 3)):  # the kernel's error, from the Python layer
            assert fused_layers(model, CachedAttention(cache, torch.ones(shape, dtype=torch.bool)), x) is None
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


def tree(parents: list[int]):
    """A tree's verification input as decode/speculative.verify_draft makes it: (positions [1, n + 1], mask [1, n + 1,
    S]) over a cache of ``length`` slots."""
    layout = compile_tree(parents)
    return len(parents) + 1, lambda length: (target_positions(layout, length)[None],
                                             tree_attention_mask(layout, length)[None])


def open_mask(length: int, seq: int = 6):
    """Not causal: each query sees a random half of the cache and of the block, later slots too, and itself (where
    the kernel's causal flag would hide slots: it must be off, as the Python layer passes it)."""
    mask = torch.rand(1, seq, length + seq, generator=torch.Generator().manual_seed(length)) > 0.5
    mask[0, torch.arange(seq), length + torch.arange(seq)] = True
    return None, mask


def one_row_mask(length: int, seq: int = 4):
    """One mask row for every query ([1, 1, S]): the first slots and the last new one hidden."""
    mask = torch.ones(1, 1, length + seq, dtype=torch.bool)
    mask[..., :3] = False
    mask[..., -1] = False
    return None, mask


MASKS = {"branches": tree([-1, 0, 0, 1, -1, 4, 2]), "siblings": tree([-1, -1, -1]), "chain": tree([-1, 0, 1, 2]),
         "open": (6, open_mask), "one-row": (4, one_row_mask)}


def masked_forward_pair(model, monkeypatch, seq: int, inputs, prefill: int = 12, taps=(0, 2)):
    """Logits, taps and cache contents of a prefill, then two forwards of ``seq`` tokens with explicit masks
    (``inputs(length)`` -> (positions or None, mask [1, T or 1, S])), then a single step, through the fused layers and
    the Python ones; and whether the fused layers ran for each masked forward."""
    ids = torch.randint(0, 256, (1, prefill + 2 * seq + 1), generator=torch.Generator().manual_seed(5))
    results, fused_masked = [], []
    original = decoder.fused_layers

    def spy(model, context, x):
        runner = original(model, context, x)
        if getattr(context, "mask", None) is not None:
            fused_masked.append(runner is not None)
        return runner

    monkeypatch.setattr(decoder, "fused_layers", spy)
    for switch in ("on", "off"):
        monkeypatch.setenv(ENV, switch)
        reload_settings()
        cache, outs = model.new_cache(64), []
        with torch.inference_mode():
            out = model(ids[:, :prefill], cache=cache, logits="all", hidden_layers=taps)
            outs.append((out.logits, *out.hidden_states))
            for start in (prefill, prefill + seq):
                positions, mask = inputs(cache.length)
                out = model(ids[:, start:start + seq], positions=positions, cache=cache, attn_mask=mask, logits="all",
                            hidden_layers=taps)
                outs.append((out.logits, *out.hidden_states))
            out = model(ids[:, -1:], cache=cache, logits="all", hidden_layers=taps)
            outs.append((out.logits, *out.hidden_states))
        end = cache.length
        results.append((outs, cache.keys[:, :, :, :end].clone(), cache.values[:, :, :, :end].clone()))
    return results, fused_masked


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("key", ["qwen2", "llama"])
@pytest.mark.parametrize("mask", list(MASKS))
def test_fused_layers_with_a_mask_equal_the_python_layers_bitwise(tiny_model_dirs, monkeypatch, backend, dtype, key,
                                                                  mask):
    model = gguf_model(tiny_model_dirs[key], dtype, backend)
    ((fused, keys, values), (python, keys_ref, values_ref)), ran = masked_forward_pair(model, monkeypatch,
                                                                                        *MASKS[mask])
    assert ran == [True, True, False, False]  # the fused layers took both masked forwards; DFLASH2_GGUF_LAYER=off none
    assert len(fused) == len(python) == 4
    for got, expected in zip(fused, python):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(keys, keys_ref) and torch.equal(values, values_ref)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("k, num_candidates", [(4, 2), (8, 4)])
def test_tree_speculation_stays_lossless_with_fused_layers(tiny_model_dirs, monkeypatch, backend, k, num_candidates):
    monkeypatch.delenv(ENV, raising=False)
    reload_settings()
    target = gguf_model(tiny_model_dirs["qwen2"], "bf16", backend)
    prompt = repetitive_prompt()
    drafter = NgramDrafter(k, num_candidates=num_candidates)
    capacity = len(prompt) + NEW_TOKENS + drafter.max_draft_tokens + 1
    expected = plain_ids(target, prompt, capacity)
    stats = DecodeStats()
    assert spec_ids(target, drafter, prompt, capacity, stats=stats) == expected
    assert stats.target_forwards > 0
    monkeypatch.setenv(ENV, "off")
    reload_settings()
    assert spec_ids(target, drafter, prompt, capacity) == expected  # the Python layers: the same tokens
