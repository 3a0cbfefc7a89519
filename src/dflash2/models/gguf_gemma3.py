"""What a Gemma 3 GGUF (llama.cpp's ``gemma3`` architecture) needs beyond a Llama one to become a Hugging Face
``Gemma3ForCausalLM`` directory (:mod:`dflash2.models.gguf_convert` calls these).

What llama.cpp does when it writes a Gemma 3 GGUF (``convert_hf_to_gguf.py``, ``Gemma3Model``; its loader in
``llama-model.cpp``), and so what is undone or restored here:

- every norm weight is stored as ``1 + w`` (llama.cpp's RMSNorm multiplies by the weight as it is, Gemma's by one
  plus it): one is subtracted back, in fp32;
- q/k rows are not permuted (Gemma rotates halves, as llama.cpp's NEOX rope does);
- the metadata has the sliding window but neither the layer pattern, the local RoPE base nor the attention scale:
  llama.cpp fixes them for ``gemma3`` (every 6th layer global, a local base of 10000, scores scaled by
  ``head_dim ** -0.5``, by ``(hidden / heads) ** -0.5`` for the 62-layer 27B), and so does the config written here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ARCHITECTURE = "gemma3"
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
ROPE_LOCAL_BASE = 10_000.0  # llama.cpp: rope_freq_base_train_swa for gemma3
LAYERS_OF_27B = 62  # llama.cpp scales the 27B's scores by (hidden / heads) ** -0.5 instead of head_dim's

# GGUF block tensor (without .weight) -> Hugging Face name, where Gemma 3 differs from Llama
BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def hf_norm_weight(values: np.ndarray) -> np.ndarray:
    """A norm weight as llama.cpp stored it (1 + w, fp32 [D]) -> Gemma's w."""
    return values - np.float32(1.0)


def is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def config_fields(hidden_size: int, num_heads: int, head_dim: int, num_layers: int, sliding_window: int | None
                  ) -> dict[str, Any]:
    """The Gemma3TextConfig fields beyond a Llama config.json, with the values llama.cpp runs the GGUF with."""
    scalar = hidden_size // num_heads if num_layers == LAYERS_OF_27B else head_dim
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "sliding_window": sliding_window or 4096,
        "layer_types": ["sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention"
                        for i in range(num_layers)],
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
    }
