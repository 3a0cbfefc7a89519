"""The DFlash drafter's configuration and its ``config.json`` (DFlash convention: the layer config plus
``block_size``, ``target_layer_ids``, ``mask_token_id``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from dflash2.models.config import ModelConfig

ARCHITECTURE = "DFlashDraftModel"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """Taps spread evenly from layer 1 to layer L - 3 (36 layers, 5 taps -> 1, 9, 17, 25, 33); one tap -> L // 2.

    Targets too shallow for that range (L - 3 <= 1) spread the taps over all layers 0 .. L - 1.
    """
    if num_taps <= 0 or num_target_layers <= 0:
        raise ValueError(f"need >= 1 tap and >= 1 target layer, got {num_taps} taps of {num_target_layers} layers")
    if num_taps == 1:
        return (num_target_layers // 2,)
    first, last = 1, num_target_layers - 3
    if last <= first:
        first, last = 0, num_target_layers - 1
    return tuple(first + (last - first) * i // (num_taps - 1) for i in range(num_taps))


def default_mask_token_id(
    vocab_size: int,
    *,
    reserved: Iterable[int] = (),
    pad_token_id: int | None = None,
    tokenizer_size: int | None = None,
) -> int:
    """A safe id for the block's mask positions: never one of ``reserved`` (EOS / BOS ids).

    Preference: the pad token; else the last embedding row when the tokenizer leaves rows unused
    (``tokenizer_size < vocab_size``, e.g. Qwen2.5); else the highest id not reserved.
    """
    reserved = set(reserved)
    if pad_token_id is not None and 0 <= pad_token_id < vocab_size and pad_token_id not in reserved:
        return pad_token_id
    if tokenizer_size is not None and tokenizer_size < vocab_size and vocab_size - 1 not in reserved:
        return vocab_size - 1
    for candidate in range(vocab_size - 1, -1, -1):
        if candidate not in reserved:
            return candidate
    raise ValueError("every id of the vocabulary is reserved; no mask token id available")


@dataclass(frozen=True)
class DFlashConfig:
    """Shape and conditioning of a DFlash drafter."""

    hidden_size: int  # D: the drafter's width, equal to the target's (it reads the target's embeddings)
    intermediate_size: int  # SwiGLU hidden width of each drafter layer
    num_layers: int  # drafter decoder layers
    num_heads: int  # query heads per drafter layer
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int  # Dh
    vocab_size: int  # the target's vocabulary (rows of its embedding, outputs of its head)
    target_layer_ids: tuple[int, ...]  # tapped target layers (output of decoder layer i), concatenated in order
    mask_token_id: int  # the id whose (target) embedding fills the block's mask positions; never an EOS id
    block_size: int = 16  # block positions: the pending token + (block_size - 1) masks -> block_size - 1 drafts
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # the target's, so that context and block positions rotate alike
    rope_scaling: dict[str, Any] | None = None  # the target's rope scaling (None | linear | llama3)
    attention_bias: bool = False  # biases on q/k/v (set when warm-starting from a Qwen2 target)
    qk_norm: bool = False  # per-head RMSNorm on q and k (Qwen3 layers: the layout other engines' loaders build)
    num_target_layers: int = 0  # the target's depth (recorded in config.json; 0 = unknown)
    target_model: str = ""  # the target's name, recorded in config.json
    draft_vocab_size: int = 0  # > 0: the head scores only this many frequent ids (``draft_vocab``); 0 = all V
    selector_rank: int = 0  # DFlash2 path selector: rank of its pair codebooks (0 = no selector, plain DFlash)
    selector_top_k: int = 16  # DFlash2: candidates per block position the selector chooses among
    conv_group: int = 0  # DFlash2 dynamic convolution: channels per tap group (0 = no convolution)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown config.json keys, kept on save

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one pending token + masks), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: a DFlash drafter needs at least one tapped layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.conv_group and self.hidden_size % self.conv_group:
            raise ValueError(f"conv_group {self.conv_group} does not divide hidden_size {self.hidden_size}")
        if self.selector_rank < 0 or self.selector_top_k < 1:
            raise ValueError("selector_rank must be >= 0 and selector_top_k >= 1")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} outside [0, {self.vocab_size}]")
        if self.num_target_layers and max(self.target_layer_ids) >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} exceed the target's {self.num_target_layers} layers"
            )

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
        attention_bias: bool | None = None,
        qk_norm: bool = False,
        target_model: str = "",
        draft_vocab_size: int = 0,
        selector_rank: int = 0,
        selector_top_k: int = 16,
        conv_group: int = 0,
    ) -> "DFlashConfig":
        """A drafter shaped like ``target``'s layers; ``num_layers`` taps by default (one per drafter layer)."""
        if mask_token_id is None:
            reserved = set(target.eos_token_ids) | ({target.bos_token_id} if target.bos_token_id is not None else set())
            mask_token_id = default_mask_token_id(target.vocab_size, reserved=reserved)
        if mask_token_id in target.eos_token_ids:
            raise ValueError(f"mask_token_id {mask_token_id} is a stop (EOS) id of the target")
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            target_layer_ids=tuple(target_layer_ids or default_target_layer_ids(target.num_layers, num_layers)),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            attention_bias=target.qkv_bias if attention_bias is None else attention_bias,
            qk_norm=qk_norm,
            num_target_layers=target.num_layers,
            target_model=target_model,
            draft_vocab_size=draft_vocab_size,
            selector_rank=selector_rank,
            selector_top_k=selector_top_k,
            conv_group=conv_group,
        )

    def layer_config(self) -> ModelConfig:
        """The decoder config the building blocks (RMSNorm, SwiGLU, rope) are made from."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, qkv_bias=self.attention_bias,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """``config.json`` in the DFlash convention (keys top-level and mirrored under ``dflash_config``)."""
        dflash = {"block_size": self.block_size, "target_layer_ids": list(self.target_layer_ids),
                  "mask_token_id": self.mask_token_id}
        raw = dict(self.extra)
        raw.update({
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "vocab_size": self.vocab_size,
            "attention_bias": self.attention_bias,
            "qk_norm": self.qk_norm,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "target_model": self.target_model,
            "draft_vocab_size": self.draft_vocab_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
            "conv_group": self.conv_group,
            **dflash,
            "dflash_config": dflash,
        })
        return raw

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "DFlashConfig":
        nested = raw.get("dflash_config") or {}

        def pick(name: str, default: Any = None) -> Any:
            return nested.get(name, raw.get(name, default))

        if pick("target_layer_ids") is None or pick("mask_token_id") is None:
            raise ValueError("not a DFlash drafter config: target_layer_ids / mask_token_id missing")
        num_heads = raw["num_attention_heads"]
        known = {"architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                 "rope_scaling", "vocab_size", "attention_bias", "qk_norm", "hidden_act", "tie_word_embeddings",
                 "num_target_layers", "target_model", "draft_vocab_size", "selector_rank",
                 "selector_top_k", "conv_group", "block_size", "target_layer_ids",
                 "mask_token_id",
                 "dflash_config"}
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            vocab_size=raw["vocab_size"],
            target_layer_ids=tuple(pick("target_layer_ids")),
            mask_token_id=int(pick("mask_token_id")),
            block_size=int(pick("block_size", 16)),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=bool(raw.get("qk_norm", False)),
            num_target_layers=int(raw.get("num_target_layers") or 0),
            target_model=raw.get("target_model") or "",
            draft_vocab_size=int(raw.get("draft_vocab_size") or 0),
            selector_rank=int(raw.get("selector_rank") or 0),
            selector_top_k=int(raw.get("selector_top_k") or 16),
            conv_group=int(raw.get("conv_group") or 0),
            extra={key: value for key, value in raw.items() if key not in known},
        )
