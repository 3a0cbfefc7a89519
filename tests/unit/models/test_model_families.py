"""Families beyond Llama / Qwen2 against transformers (the oracle) on tiny random models in fp32: Qwen3 (q/k norms,
a head_dim of its own), Llama 3.x (llama3 RoPE scaling); an unsupported architecture is a one-line error."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash2.kv.static import StaticKVCache
from dflash2.models.config import ModelConfig
from dflash2.models.loading import load_transformer

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)


def qwen3() -> torch.nn.Module:
    model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, rope_theta=10000.0, max_position_embeddings=512,
                                         tie_word_embeddings=False, **COMMON))
    for name, param in model.named_parameters():  # q/k norm weights away from 1 so that applying them matters
        if "q_norm" in name or "k_norm" in name:
            param.data.uniform_(0.5, 1.5)
    return model


def llama3() -> torch.nn.Module:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # short, so the positions below reach the scaled band
    return LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=1024,
                                        tie_word_embeddings=True, **COMMON))


@pytest.fixture(scope="module", params=[qwen3, llama3], ids=["qwen3", "llama3"])
def pair(request, tmp_path_factory):
    torch.manual_seed(5)
    model = request.param().float().eval()
    for param in model.parameters():  # sharper logits than the default init
        if param.dim() == 2:
            param.data.mul_(2.0)
    path = tmp_path_factory.mktemp(request.param.__name__)
    model.save_pretrained(str(path))
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval(), load_transformer(path, "fp32")


@torch.inference_mode()
def test_logits_match_transformers(pair):
    oracle, lean = pair
    ids = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(3))  # past 64 original positions
    assert torch.allclose(lean(ids).logits, oracle(ids).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_cached_decoding_matches_the_full_forward(pair):
    _, lean = pair
    ids = torch.randint(0, 256, (1, 90), generator=torch.Generator().manual_seed(4))
    full = lean(ids).logits
    c = lean.config
    cache = StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 128, dtype=torch.float32)
    pieces = [lean(ids[:, :80], cache=cache).logits] + [lean(ids[:, i : i + 1], cache=cache).logits
                                                        for i in range(80, 90)]
    assert torch.allclose(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_qwen3_reads_its_norms_and_head_dim(pair):
    _, lean = pair
    if lean.config.model_type == "qwen3":
        assert lean.config.qk_norm and lean.config.head_dim == 32 and not lean.config.qkv_bias
        assert lean.layers[0].attn.q_norm.weight.shape == (32,)
    else:
        assert lean.config.rope_scaling["rope_type"] == "llama3" and lean.layers[0].attn.q_norm is None


def test_unsupported_architecture_names_what_is_supported(tmp_path):
    raw = {"model_type": "gpt_neox", **COMMON}
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf_dict(raw)
    message = str(error.value)
    assert "\n" not in message and "gpt_neox" in message
    for family in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text"):
        assert family in message
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="unsupported model_type"):
        ModelConfig.from_dir(tmp_path)
