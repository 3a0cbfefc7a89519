"""The decoder's configuration, read from a Hugging Face style ``config.json`` (Llama / Qwen2 / Qwen3 / Gemma 3)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.models.validate import check_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text")  # Llama 3.x: "llama" with llama3 RoPE
GEMMA3 = "gemma3_text"  # Gemma 3's text decoder (Gemma3ForCausalLM; the GGUF's "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"  # Gemma 3's layer types


@dataclass(frozen=True)
class Gemma3Options:
    """What Gemma 3's decoder does beyond the Llama layout (``ModelConfig.gemma3``; None for the other families)."""

    query_pre_attn_scalar: float  # attention scores scaled by its -1/2 power instead of head_dim's
    sliding_window: int  # a sliding layer's query sees the keys at positions p - window < k <= p
    layer_types: tuple[str, ...]  # per layer: SLIDING or FULL
    rope_local_theta: float  # the sliding layers' RoPE base (no scaling); full layers use rope_theta + rope_scaling
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) when set

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int  # model width D
    intermediate_size: int  # SwiGLU hidden width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None | {"rope_type": "linear" | "llama3", ...}
    max_position_embeddings: int = 4096
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v, none on o
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    tie_word_embeddings: bool = False
    model_type: str = "llama"
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # Gemma 3: (1 + weight) RMSNorms, four per layer, q/k norms, embeddings times sqrt(D), GeGLU (tanh gelu),
    # sliding-window layers with their own RoPE base; None for the other families
    gemma3: Gemma3Options | None = None

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; dflash2 runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(Llama 3.x as llama)")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        gemma3 = _gemma3_options(raw, raw["num_hidden_layers"]) if model_type == GEMMA3 else None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        qkv_bias = model_type == "qwen2" or bool(raw.get("attention_bias", False))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw, model_type),
            rope_scaling=_rope_scaling(_full_rope_parameters(raw) if model_type == GEMMA3 else raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            gemma3=gemma3,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        check_config(path)  # sizes positive, bounded and consistent: a one-line ModelFileError if not
        return cls.from_hf_dict(json.loads(path.read_text()))


def _full_rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's global-layer RoPE: ``rope_parameters["full_attention"]`` (transformers >= 5) or the older flat
    ``rope_theta`` / ``rope_scaling``, as one dict read like another family's config."""
    nested = (raw.get("rope_parameters") or {}).get(FULL)
    if nested is not None:
        return {"rope_parameters": nested}
    return {"rope_scaling": raw.get("rope_scaling"), "rope_theta": raw.get("rope_theta", 1_000_000.0)}


def _rope_theta(raw: dict[str, Any], model_type: str) -> float:
    if model_type == GEMMA3:
        full = _full_rope_parameters(raw)
        return float((full.get("rope_parameters") or full).get("rope_theta", 1_000_000.0))
    return raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def _gemma3_options(raw: dict[str, Any], num_layers: int) -> Gemma3Options:
    """Gemma 3's extras, with transformers' defaults (Gemma3TextConfig) where a key is absent."""
    if raw.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported (the attention kernel has no capping)")
    if raw.get("attention_bias"):
        raise ValueError("Gemma 3 with attention_bias is not supported (released Gemma 3 models have none)")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported (dflash2 decodes causally)")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 3 with hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
    pattern = int(raw.get("sliding_window_pattern") or 6)  # older configs: every pattern-th layer is full
    layer_types = raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(layer_types) != num_layers or any(kind not in (SLIDING, FULL) for kind in layer_types):
        raise ValueError(f"Gemma 3 layer_types must name {num_layers} layers, each {SLIDING!r} or {FULL!r}")
    local = (raw.get("rope_parameters") or {}).get(SLIDING) or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 3 sliding layers with rope_type {local['rope_type']!r} are not supported")
    window = raw.get("sliding_window") or 4096
    return Gemma3Options(
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),
        sliding_window=int(window),
        layer_types=tuple(layer_types),
        rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", 10_000.0))),
        final_logit_softcapping=raw.get("final_logit_softcapping"),
    )


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    return dict(scaling, rope_type=rope_type)
