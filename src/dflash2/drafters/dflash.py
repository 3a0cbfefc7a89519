"""DFlash: a block drafter that reads the target's hidden states and drafts a whole block in one pass.

The drafter is a small stack of ordinary decoder layers at the target's width, with no embedding or head of
its own: block inputs are the target's (frozen) embeddings and draft logits come from the target's (frozen)
LM head. It is conditioned on the target through a *context*: the hidden states of a few tapped target
layers, concatenated along features, projected by ``fc`` and RMS-normed. In every drafter layer the context
goes through that layer's own k/v projections (rotary at the context positions) and is prepended to the
block's keys/values; queries come only from the block.

A block is ``[pending token, MASK x (block_size - 1)]`` at positions ``start .. start + block_size - 1``,
where ``start`` is the pending token's position. Attention inside the block is bidirectional and every block
position sees the whole context, i.e. exactly the committed positions ``0 .. start - 1``. Block position
``j >= 1`` yields the draft for position ``start + j``: one forward pass gives ``block_size - 1`` drafts.

Context bookkeeping (:class:`DFlashDrafter`): the projected context K/V of every committed position live in
a :class:`~dflash2.kv.StaticKVCache`; the block's own K/V are never stored. The pending token's taps are only
known after the verification pass that writes it into the target's cache, so after every ``observe`` the
cache holds ``len(sequence) - 1`` positions: every committed token except the pending one.

Checkpoints follow the DFlash convention (a Hugging Face style directory: ``config.json`` with the layer
config plus ``block_size``, ``target_layer_ids``, ``mask_token_id``; ``model.safetensors`` without
embedding or head), so drafters trained here can be served by engines that load DFlash drafters.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dflash2.drafters.base import Draft, Drafter
from dflash2.kv.static import StaticKVCache
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import FeedForward, RMSNorm, Transformer, rope_inverse_frequencies, rotate_half
from dflash2.verify.sampling import SamplingParams, logits_to_probs, sample

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
    num_target_layers: int = 0  # the target's depth (recorded in config.json; 0 = unknown)
    target_model: str = ""  # the target's name, recorded in config.json
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # unknown config.json keys, kept on save

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (one pending token + masks), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: a DFlash drafter needs at least one tapped layer")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
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
        target_model: str = "",
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
            num_target_layers=target.num_layers,
            target_model=target_model,
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
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "target_model": self.target_model,
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
                 "rope_scaling", "vocab_size", "attention_bias", "hidden_act", "tie_word_embeddings",
                 "num_target_layers", "target_model", "block_size", "target_layer_ids", "mask_token_id",
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
            num_target_layers=int(raw.get("num_target_layers") or 0),
            target_model=raw.get("target_model") or "",
            extra={key: value for key, value in raw.items() if key not in known},
        )


class DFlashAttention(nn.Module):
    """Block queries over [context K/V ; block K/V]. Parameter names match the decoder's attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_width = config.num_heads * config.head_dim
        self.kv_width = config.num_kv_heads * config.head_dim
        self.wqkv = nn.Linear(config.hidden_size, self.q_width + 2 * self.kv_width, bias=config.qkv_bias)
        self.wo = nn.Linear(self.q_width, config.hidden_size, bias=False)

    def _heads(self, x: torch.Tensor, num_heads: int) -> torch.Tensor:  # [B, T, H * Dh] -> [B, H, T, Dh]
        return x.view(x.shape[0], x.shape[1], num_heads, self.head_dim).transpose(1, 2)

    def context_kv(
        self,
        context: torch.Tensor,  # [B, S, D] projected context
        cos: torch.Tensor,  # [B, 1, S, Dh] at the context positions
        sin: torch.Tensor,  # [B, 1, S, Dh]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys/values of the context: ([B, H_kv, S, Dh], [B, H_kv, S, Dh]); q is not computed."""
        bias = None if self.wqkv.bias is None else self.wqkv.bias[self.q_width :]
        k, v = F.linear(context, self.wqkv.weight[self.q_width :], bias).split(self.kv_width, dim=-1)
        k = self._heads(k, self.num_kv_heads)
        return k * cos + rotate_half(k) * sin, self._heads(v, self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D] block (normed)
        cos: torch.Tensor,  # [B, 1, T, Dh] at the block positions
        sin: torch.Tensor,  # [B, 1, T, Dh]
        context_k: torch.Tensor,  # [B, H_kv, S, Dh]
        context_v: torch.Tensor,  # [B, H_kv, S, Dh]
        attn_mask: torch.Tensor | None,  # [B or 1, 1, T, S + T] bool, True = may attend; None = all
    ) -> torch.Tensor:
        q, k, v = self.wqkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        q, k, v = self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads), self._heads(v, self.num_kv_heads)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        keys = torch.cat([context_k.to(k.dtype), k], dim=2)  # [B, H_kv, S + T, Dh]
        values = torch.cat([context_v.to(v.dtype), v], dim=2)  # [B, H_kv, S + T, Dh]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=attn_mask, enable_gqa=self.num_kv_heads != self.num_heads
        )  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class DFlashLayer(nn.Module):
    """An ordinary pre-norm decoder layer (RMSNorm, attention, SwiGLU) whose attention takes the context K/V."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DFlashAttention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x, cos, sin, context_k, context_v, attn_mask):  # x: [B, T, D] -> [B, T, D]
        x = x + self.attn(self.attn_norm(x), cos, sin, context_k, context_v, attn_mask)
        return x + self.ffn(self.ffn_norm(x))


ContextKV = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per drafter layer: ([B, H_kv, S, Dh], [B, H_kv, S, Dh])


class DFlashDraftModel(nn.Module):
    """The drafter network. Holds no embedding or head: the target's are passed in (:meth:`embed`, :meth:`logits`)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        width = config.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(layer_config) for _ in range(config.num_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * width, width, bias=False)
        self.hidden_norm = RMSNorm(width, config.rms_norm_eps)  # on the projected context
        self.norm = RMSNorm(width, config.rms_norm_eps)  # before the target's head
        self.register_buffer("inv_freq", rope_inverse_frequencies(layer_config), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin), each [B, 1, T, Dh] in the model dtype (angles in fp32)."""
        angles = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [B, T, Dh / 2]
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, T, Dh]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def project_context(self, taps: Sequence[torch.Tensor]) -> torch.Tensor:
        """Tapped target hidden states, one [B, S, D] per target_layer_ids entry -> the context [B, S, D]."""
        stacked = torch.cat([t.to(self.dtype) for t in taps], dim=-1)  # [B, S, n_taps * D]
        return self.hidden_norm(self.fc(stacked))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context [B, S, D] at positions [B, S] -> each layer's rotated context (K, V), [B, H_kv, S, Dh] each."""
        cos, sin = self.rope(positions)
        return [layer.attn.context_kv(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, T, D] target embeddings of the block ids
        positions: torch.Tensor,  # [B, T] int64 block positions
        context_kv: ContextKV,  # per layer, the context K/V ([B, H_kv, S, Dh] each)
        attn_mask: torch.Tensor | None = None,  # [B or 1, T, S + T] bool over [context ; block]; None = all
    ) -> torch.Tensor:
        """The block's final hidden states [B, T, D], normed by the drafter's own RMSNorm."""
        cos, sin = self.rope(positions)
        mask = attn_mask[:, None] if attn_mask is not None else None  # [B, 1, T, S + T]
        x = block_embeds.to(self.dtype)
        for layer, (context_k, context_v) in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, context_k, context_v, mask)
        return self.norm(x)

    @staticmethod
    def embed(target: Transformer, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> the target's (frozen) embeddings [B, T, D]."""
        return target.embed(ids.to(target.device))

    @staticmethod
    def logits(target: Transformer, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V] through the target's (frozen) LM head.

        The input is cast to the head's weight dtype when the head is an ``nn.Linear`` (a trainer may hold an fp32
        copy of a bf16 target's head); a packed head takes any float dtype.
        """
        head = target.lm_head
        dtype = head.weight.dtype if isinstance(head, nn.Linear) else target.dtype
        return head(hidden.to(dtype)).float()

    # ---- warm start, save, load ----------------------------------------------------------------------------

    @torch.no_grad()
    def init_from_target(self, target: Transformer, layer_ids: Sequence[int] | None = None) -> None:
        """Copy target layers into the drafter layers (default: the target's last ``num_layers`` layers).

        ``fc`` starts as the mean of the taps. Requires matching layer shapes. Whether this helps is unmeasured.
        """
        count = len(self.layers)
        layer_ids = tuple(layer_ids) if layer_ids is not None else tuple(range(target.config.num_layers - count,
                                                                              target.config.num_layers))
        if len(layer_ids) != count:
            raise ValueError(f"need {count} target layer ids, got {layer_ids}")
        for layer, index in zip(self.layers, layer_ids):
            source = target.layers[index].state_dict()
            own = layer.state_dict()
            if source.keys() != own.keys() or any(source[k].shape != own[k].shape for k in own):
                raise ValueError(f"target layer {index} does not match the drafter's layer shape")
            layer.load_state_dict({k: v.to(self.dtype) for k, v in source.items()})
        width, taps = self.config.hidden_size, len(self.config.target_layer_ids)
        eye = torch.eye(width, dtype=self.dtype, device=self.device) / taps
        self.fc.weight.copy_(eye.repeat(1, taps))

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (HF names, no embedding or head), atomically."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            tmp.chmod(0o755)
            tensors = {name: t.detach().to("cpu").contiguous() for name, t in to_hf_state_dict(self).items()}
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            raw = self.config.to_hf_dict()
            raw["torch_dtype"] = str(self.dtype).removeprefix("torch.")
            (tmp / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")
            replace_directory(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return directory

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu"
    ) -> "DFlashDraftModel":
        from dflash2.models.loading import parse_dtype

        directory = Path(directory)
        config = DFlashConfig.from_hf_dict(json.loads((directory / CONFIG_FILE).read_text()))
        torch_dtype = parse_dtype(dtype)
        with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as handle:
            hf = {name: handle.get_tensor(name) for name in handle.keys()}
        state = {k: v.to(device=device, dtype=torch_dtype) for k, v in from_hf_state_dict(hf, config).items()}
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, assign=True)
        model.inv_freq = rope_inverse_frequencies(config.layer_config()).to(device)
        return model.eval()


def replace_directory(source: Path, destination: Path) -> None:
    """Move the finished directory ``source`` to ``destination``, replacing what was there (atomic rename)."""
    if destination.exists():
        old = destination.with_name(f".{destination.name}.old-{os.getpid()}")
        os.replace(destination, old)
        os.replace(source, destination)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, destination)


_LAYER_NAMES = {  # this module's per-layer names -> DFlash / HF names (q/k/v and gate/up are split on save)
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w_down.weight": "mlp.down_proj.weight",
}


def to_hf_state_dict(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """The drafter's weights under DFlash / HF names (``layers.i.self_attn.q_proj.weight``, ``fc.weight``, ...)."""
    config, state = model.config, model.state_dict()
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    out = {"fc.weight": state["fc.weight"], "hidden_norm.weight": state["hidden_norm.weight"],
           "norm.weight": state["norm.weight"]}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"layers.{i}."
        for ours, theirs in _LAYER_NAMES.items():
            out[dst + theirs] = state[src + ours]
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            q, k, v = state[src + f"attn.wqkv.{kind}"].split((q_width, kv_width, kv_width))
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v})
        gate, up = state[src + "ffn.w_gate_up.weight"].chunk(2)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: DFlashConfig) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_state_dict`; refuses checkpoints carrying weights this model does not have."""
    state = {"fc.weight": hf["fc.weight"], "hidden_norm.weight": hf["hidden_norm.weight"],
             "norm.weight": hf["norm.weight"]}
    used = set(state)
    for i in range(config.num_layers):
        src = f"layers.{i}."
        for ours, theirs in _LAYER_NAMES.items():
            state[src + ours] = hf[src + theirs]
            used.add(src + theirs)
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            names = [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
            state[src + f"attn.wqkv.{kind}"] = torch.cat([hf[n] for n in names])
            used.update(names)
        names = [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]
        state[src + "ffn.w_gate_up.weight"] = torch.cat([hf[n] for n in names])
        used.update(names)
    unknown = sorted(set(hf) - used)
    if unknown:
        raise ValueError(f"the checkpoint has weights a DFlash drafter does not use: {unknown[:5]}")
    return state


class DFlashDrafter(Drafter):
    """Drafts ``block_size - 1`` tokens per target pass from one drafter forward over the block.

    Greedy drafts at T = 0 (``q_draft`` None); at T > 0 each position is sampled independently from its
    warped distribution, and ``q_draft`` [k, V] goes to rejection sampling.
    """

    name = "dflash"

    def __init__(self, model: DFlashDraftModel, target: Transformer, num_draft_tokens: int | None = None) -> None:
        limit = model.config.block_size - 1
        num_draft_tokens = limit if num_draft_tokens is None else num_draft_tokens
        if num_draft_tokens > limit:
            raise ValueError(f"a block of {model.config.block_size} yields at most {limit} drafts, "
                             f"asked for {num_draft_tokens}")
        config = model.config
        if (config.vocab_size, config.hidden_size) != (target.config.vocab_size, target.config.hidden_size):
            raise ValueError("the DFlash drafter was made for a target of another width or vocabulary")
        if max(config.target_layer_ids) >= target.config.num_layers:
            raise ValueError(
                f"target_layer_ids {config.target_layer_ids} exceed the target's {target.config.num_layers} layers"
            )
        super().__init__(num_draft_tokens)
        self.model = model.eval()
        self.target = target
        self.hidden_layers = tuple(model.config.target_layer_ids)
        self.cache: StaticKVCache | None = None  # context K/V of the committed positions, pending token excluded

    @property
    def context_length(self) -> int:
        """Committed positions whose context K/V are cached (= the next block's start position)."""
        return 0 if self.cache is None else self.cache.length

    def reset(self, capacity: int) -> None:
        c = self.model.config
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = StaticKVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity,
                                       dtype=self.model.dtype, device=self.model.device)
        self.cache.reset()

    @torch.inference_mode()
    def observe(self, sequence: list[int], num_accepted: int, target_hidden: tuple[torch.Tensor, ...]) -> None:
        """Append the context K/V of the newly committed positions (their taps just came from the target).

        The taps cover positions ``[before, before + n)`` with ``before = len(sequence) - 1 - n``: the newest
        token of ``sequence`` is pending and has no taps yet. Cached context past ``before`` is cropped.
        """
        assert self.cache is not None, "reset() must be called before observe()"
        if num_accepted < 0:
            self.cache.reset()
        count = target_hidden[0].shape[1]
        before = len(sequence) - 1 - count
        if before < 0:
            raise ValueError(f"{count} tapped positions do not fit a sequence of {len(sequence)} ids")
        if self.cache.length > before:
            self.cache.rollback(before)
        elif self.cache.length < before:
            raise RuntimeError(f"context gap: {self.cache.length} positions cached, taps start at {before}")
        positions = torch.arange(before, before + count, device=self.model.device)[None]  # [1, n]
        context = self.model.project_context(target_hidden)  # [1, n, D]
        for layer, (k, v) in enumerate(self.model.context_kv(context, positions)):
            self.cache.write(layer, k, v)
        self.cache.advance(count)

    @torch.inference_mode()
    def propose(
        self, sequence: list[int], num_draft_tokens: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        assert self.cache is not None, "reset() must be called before propose()"
        k = min(num_draft_tokens, self.num_draft_tokens)
        if k <= 0:
            return Draft(tokens=torch.zeros(0, dtype=torch.int64), q_draft=None)
        start = len(sequence) - 1  # the pending token's position
        if self.cache.length != start:
            raise RuntimeError(f"the drafter's context holds {self.cache.length} positions, expected {start}")
        logits = self.block_logits(sequence[-1], start)[1 : k + 1]  # [k, V]
        return _draft_from_logits(logits, params, generator)

    @torch.inference_mode()
    def propose_ahead(self, sequence, block, num_draft_tokens, params: SamplingParams, generator) -> Draft | None:
        """Pre-draft before the taps of ``block`` exist: the block's tokens fill the first mask positions
        ([pending, block..., MASK...]) and the masks after them draft the bonus guess and the next block.
        None when the masks left cannot hold the guess and one draft (len(block) >= block_size - 2)."""
        assert self.cache is not None, "reset() must be called before propose_ahead()"
        first = len(block) + 1  # block position of the bonus guess
        last = min(first + num_draft_tokens, self.model.config.block_size - 1)
        if last <= first:  # room for the bonus guess and at least one draft after it
            return None
        start = len(sequence) - 1
        if self.cache.length != start:
            raise RuntimeError(f"the drafter's context holds {self.cache.length} positions, expected {start}")
        logits = self.block_logits(sequence[-1], start, known=block)[first : last + 1]  # [1 + n, V]
        return _draft_from_logits(logits, params, generator)

    def block_logits(self, pending: int, start: int, known: Sequence[int] = ()) -> torch.Tensor:
        """float32 logits [block_size, V] of the block [pending, known..., MASK...] at positions start .. start +
        bs - 1 (``known``: tokens already drafted after the pending one, used by pre-drafting)."""
        config, device = self.model.config, self.model.device
        ids = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.int64, device=device)
        ids[0, 0] = pending
        ids[0, 1 : 1 + len(known)] = torch.tensor(list(known), dtype=torch.int64, device=device)
        positions = torch.arange(start, start + config.block_size, device=device)[None]  # [1, bs]
        context = [(self.cache.keys[layer, :, :, :start], self.cache.values[layer, :, :, :start])
                   for layer in range(config.num_layers)]
        hidden = self.model(self.model.embed(self.target, ids), positions, context)  # [1, bs, D]
        return self.model.logits(self.target, hidden)[0]


def _draft_from_logits(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Draft:
    """A chain from block logits [k, V]: argmax at T = 0 (q_draft None), else sampled with q_draft [k, V]."""
    if params.greedy:
        return Draft(tokens=logits.argmax(dim=-1).cpu(), q_draft=None)
    q_draft = logits_to_probs(logits, params)  # [k, V]
    return Draft(tokens=sample(q_draft, generator).cpu(), q_draft=q_draft)


def load_dflash_drafter(
    directory: str | Path,
    target: Transformer,
    num_draft_tokens: int | None = None,
    dtype: str | torch.dtype | None = None,
) -> DFlashDrafter:
    """Load a saved drafter for ``target`` (dtype and device default to the target's)."""
    model = DFlashDraftModel.from_pretrained(directory, dtype or target.dtype, target.device)
    return DFlashDrafter(model, target, num_draft_tokens)


__all__ = [
    "DFlashConfig", "DFlashDraftModel", "DFlashDrafter", "default_mask_token_id", "default_target_layer_ids",
    "load_dflash_drafter",
]
