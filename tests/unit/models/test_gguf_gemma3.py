"""A Gemma 3 GGUF written as llama.cpp writes one (its tensor names, norm weights stored as 1 + w, no layer pattern
in the metadata) converts into a directory whose logits are the original transformers model's, past the window."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

from dflash2.models.gguf_convert import convert_gguf, hf_tensor_name  # noqa: E402
from dflash2.models.loading import load_transformer  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, WINDOW = 6, 64, 4, 2, 32, 128, 300, 8
# GGUF block tensor -> transformers name (llama.cpp's gemma3 names)
GGUF_NAMES = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_q": "self_attn.q_proj",
              "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
              "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def oracle() -> Gemma3ForCausalLM:
    """What llama.cpp assumes of a gemma3 GGUF: every 6th layer global, a local base of 10000, scores scaled by
    head_dim ** -0.5 (query_pre_attn_scalar = head_dim)."""
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                              query_pre_attn_scalar=HEAD_DIM, sliding_window=WINDOW, max_position_embeddings=256,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                              attn_implementation="eager")
    torch.manual_seed(3)
    model = Gemma3ForCausalLM(config).float().eval()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.uniform_(-0.5, 0.5)
        elif param.dim() == 2:
            param.data.mul_(2.0)
    return model


def write_gemma3_gguf(path, model: Gemma3ForCausalLM) -> None:
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny-gemma3")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(WINDOW)
    state = {name: t.detach().numpy().astype(np.float32) for name, t in model.state_dict().items()}

    def add(gguf_name: str, hf_name: str) -> None:
        values = state[hf_name]
        writer.add_tensor(gguf_name, values + np.float32(1.0) if hf_name.endswith("norm.weight") else values)

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    for i in range(LAYERS):
        for part, hf_part in GGUF_NAMES.items():
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{hf_part}.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gemma3_tensor_names():
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"  # llama's


@torch.inference_mode()
def test_converted_gemma3_gguf_gives_the_original_logits(tmp_path):
    model = oracle()
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma3_gguf(path, model)
    out = convert_gguf(path, tmp_path / "converted", "fp32", tokenizer=False, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == WINDOW
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    lean = load_transformer(out, "fp32")
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))  # five windows
    assert torch.allclose(lean(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
