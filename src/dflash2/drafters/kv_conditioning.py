"""Conditioning a block drafter on the target through gated keys and values (DFlash's way, behind a closed gate).

The target's hidden states at the verified positions 0 .. n - 1, from a few of its layers, are each RMS-normalised,
concatenated and mapped by one linear ``fc`` onto the drafter's width: one context state per position. In every
drafter layer the rows of a draft pass also attend to keys and values that the layer's own (adapted) q/k/v
projection makes of these states (after the layer's own input norm, so they arrive at the scale the layer
expects; keys rotated at their positions). That attention has a softmax of its own and is added to the layer's
usual attention output times ``tanh(gate[layer])``.

Why a separate softmax behind a gate: the gate starts at 0, so an untrained conditioning drafts exactly as the
PARD adapter it starts from, whatever ``fc`` holds; ``fc`` can then start random (a zero map would leave every key
the same and give the gate nothing to learn from). The first steps move the gates where the target's states
help, and ``fc`` learns what to put there (Adam moves it at its own rate however small the gate still is).

Why keys and values rather than an input offset (``conditioning.py``): an offset added to a row's input reaches
that row only and competes with the token's own embedding; keys and values let every drafting row look up what
the target computed at any verified position, in every layer (measured: docs/pard.md).

Shipped beside a PARD adapter as ``kv_conditioning.json`` + ``kv_conditioning.safetensors``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dflash2.drafters.conditioning import config_from_record, config_record, normalised_taps
from dflash2.kernels import layer_ops
from dflash2.models.attention import attend

KV_CONDITIONING_CONFIG = "kv_conditioning.json"
KV_CONDITIONING_FILE = "kv_conditioning.safetensors"


@dataclass(frozen=True)
class KVConditioningConfig:
    target_layers: tuple[int, ...]  # decoder layers of the target whose outputs are read (0-based)
    target_hidden_size: int  # the target's width (Dt)
    hidden_size: int  # the drafter's width (D)
    num_layers: int  # the drafter's layers (one gate each)

    def save(self, directory: str | Path) -> None:
        (Path(directory) / KV_CONDITIONING_CONFIG).write_text(json.dumps(config_record(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "KVConditioningConfig":
        return config_from_record(cls, json.loads((Path(directory) / KV_CONDITIONING_CONFIG).read_text()))


class GatedKVConditioning(nn.Module):
    """taps [S, T * Dt] -> per-layer gated keys / values that a draft pass's rows attend to (module doc)."""

    def __init__(self, config: KVConditioningConfig, eps: float = 1e-6, seed: int = 0, gate_init: float = 0.0
                 ) -> None:
        super().__init__()
        self.config = config
        self.eps = eps
        width = len(config.target_layers) * config.target_hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        # unit-RMS inputs -> unit-RMS context states; the gates keep the drafts unchanged at start
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(self.fc.weight.shape, generator=generator) / math.sqrt(width))
        # [L]: tanh(gate) scales a layer's lookup; a small start of one sign keeps the projection's gradient from
        # flipping with gates that wander around 0 (measured: docs/pard.md, "Gated keys and values")
        self.gates = nn.Parameter(torch.full((config.num_layers,), float(gate_init)))

    def context_states(self, taps: torch.Tensor) -> torch.Tensor:  # [..., T * Dt] -> [..., D]
        x = normalised_taps(taps, len(self.config.target_layers), self.eps)  # [..., T * Dt]
        return self.fc(x.to(self.fc.weight.dtype))

    def layer_keys_values(self, model, layer: int, states: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafter layer ``layer``'s keys and values of context states [1, S, D] (the layer's input norm, then its
        own q/k/v projection; keys rotated by ``rope`` = (cos, sin) [1, 1, S, Dh]) -> each [1, H_kv, S, Dh]."""
        block = model.layers[layer]
        attn = block.attn
        qkv = attn.wqkv(block.attn_norm(states.to(model.dtype)))  # [1, S, (H + 2 H_kv) Dh]
        if attn.q_norm is None:
            _, keys, values = layer_ops.run_qkv_rope(qkv, *rope, attn.num_heads, attn.num_kv_heads)
        else:
            _, keys, values = attn._normed_qkv_rope(qkv, *rope)
        return keys, values

    def attention(self, model, inner, taps: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
                  ) -> "GatedTargetAttention":
        """The attention context of a training pass: ``inner`` (the drafter's own) plus the lookup of the target's
        states at ``positions`` [S] (taps [S, T * Dt]); visible [B or 1, Q, S] bool: which of them each row reads
        (a row that reads none gets no lookup)."""
        states = self.context_states(taps)[None]  # [1, S, D]
        rope = model.rope(positions[None])

        def keys_values(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.layer_keys_values(model, layer, states, rope)

        return GatedTargetAttention(self.gates, inner, keys_values, visible)

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        from safetensors.torch import save_file

        self.config.save(directory)
        save_file({name: tensor.detach().to(dtype).contiguous() for name, tensor in self.state_dict().items()},
                  str(Path(directory) / KV_CONDITIONING_FILE))

    @classmethod
    def load(cls, directory: str | Path, dtype: torch.dtype = torch.float32) -> "GatedKVConditioning":
        from safetensors.torch import load_file

        module = cls(KVConditioningConfig.load(directory))
        tensors = load_file(str(Path(directory) / KV_CONDITIONING_FILE))
        module.load_state_dict({name: tensor.to(dtype) for name, tensor in tensors.items()})
        return module.to(dtype).eval().requires_grad_(False)


def has_kv_conditioning(directory: str | Path) -> bool:
    return (Path(directory) / KV_CONDITIONING_CONFIG).exists()


class GatedTargetAttention:
    """An attention context (``models.decoder.AttentionContext``): the drafter's own attention plus, per layer,
    ``tanh(gate)`` x a separate attention of the same queries over the target's states' keys and values
    (``keys_values(layer)`` -> each [1, H_kv, S, Dh]); visible [B or 1, Q, S] bool: which of them each query row
    reads. A row that reads none gets nothing added (it attends to slot 0, then is zeroed: an empty softmax is
    NaN)."""

    def __init__(self, gates: torch.Tensor, inner, keys_values, visible: torch.Tensor) -> None:
        self.gates = gates  # [L]
        self.inner = inner
        self.keys_values = keys_values
        seen = visible.any(-1, keepdim=True)  # [B, Q, 1]
        self.empty = visible.shape[-1] == 0 or not bool(seen.any())
        self.row_scale = seen[:, None]  # [B, 1, Q, 1]
        first = torch.zeros_like(visible)
        first[..., :1] = True
        self.mask = torch.where(seen, visible, first)[:, None]  # [B, 1, Q, S]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window=None) -> torch.Tensor:
        out = self.inner.attend(layer, q, k, v, window)  # [B, H, Q, Dh]
        if self.empty:
            return out
        keys, values = self.keys_values(layer)
        lookup = attend(q, keys, values, self.mask)  # [B, H, Q, Dh]: a softmax of its own
        gate = torch.tanh(self.gates[layer]).to(out.dtype)
        return out + gate * lookup * self.row_scale.to(out.dtype)

    def finish(self, num_tokens: int) -> None:
        self.inner.finish(num_tokens)
