"""The decoder's configuration, read from a Hugging Face style ``config.json`` (Llama / Qwen2 / Qwen3 family)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash2.models.validate import check_config

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # Llama 3.x: "llama" with llama3 RoPE scaling


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

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; dflash2 runs {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(Llama 3.x as llama)")
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
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
            rope_theta=raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            model_type=model_type,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        check_config(path)  # sizes positive, bounded and consistent: a one-line ModelFileError if not
        return cls.from_hf_dict(json.loads(path.read_text()))


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    return dict(scaling, rope_type=rope_type)
