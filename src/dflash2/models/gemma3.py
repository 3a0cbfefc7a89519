"""Gemma 3's decoder layer for the lean decoder (:class:`~dflash2.models.decoder.Transformer` builds these when
``config.gemma3`` is set).

What differs from the Llama layout (the facts from transformers' ``modeling_gemma3``, the code written here):

- RMSNorm scales by ``1 + weight`` (the stored weight is an offset from one) and rounds once, after the scaling,
  in fp32 as transformers does; four per layer: before and after attention, before and after the feed-forward
  (the post-norms apply to the branch before it joins the residual);
- q and k are RMS-normed per head (the same ``1 + weight`` norm, weights [head_dim]) before RoPE;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``: the attention calls scale by ``head_dim ** -0.5``,
  so q is multiplied by their ratio first (exactly 1, and skipped, when the two are equal, as in every released
  Gemma 3 but the 27B);
- the sliding layers see only the last ``sliding_window`` positions (:class:`~dflash2.models.attention.SlidingWindow`,
  applied by the attention context as a mask in every path) and rotate with their own RoPE base; the full layers use
  ``rope_theta`` and ``rope_scaling``;
- the feed-forward is GeGLU: ``gelu_tanh(gate) * up``.

The projections keep the Llama layer's names (``attn.wqkv``, ``attn.wo``, ``ffn.w_gate_up``, ``ffn.w_down``), so
packing, quantizing and the GGUF blocks replace them the same way. The norms run as PyTorch operations: each row is
reduced on its own, so a row's bits do not depend on the other rows of a pass (verification stays lossless; tested
against one-token decoding in bf16).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.kernels import layer_ops
from dflash2.models.attention import SlidingWindow
from dflash2.models.config import ModelConfig
from dflash2.models.projections import AttentionProjections, GatedProjections


class GemmaRMSNorm(nn.Module):
    """RMSNorm with a ``1 + weight`` scale, computed in fp32 and rounded once (as transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))  # the offset from one, as stored

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D] -> [..., D] in x's dtype
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(AttentionProjections):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        assert config.gemma3 is not None
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        # the attention calls scale scores by head_dim ** -0.5; Gemma wants query_pre_attn_scalar ** -0.5
        ratio = math.sqrt(config.head_dim / config.gemma3.query_pre_attn_scalar)
        self.query_scale = None if ratio == 1.0 else ratio

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, 1, T, Dh] (this layer's RoPE: local or global)
        sin: torch.Tensor,  # [B, 1, T, Dh]
        layer: int,
        context,  # decoder.AttentionContext
        window: SlidingWindow | None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.wqkv(x).split(self.split_sizes, dim=-1)  # [B, T, H Dh], [B, T, H_kv Dh] x 2
        q = self.q_norm(q.reshape(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)  # [B, H, T, Dh]
        k = self.k_norm(k.reshape(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)  # [B, H_kv, T, Dh]
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, H_kv, T, Dh]
        q, k = layer_ops.apply_rope(q, cos, sin), layer_ops.apply_rope(k, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        out = context.attend(layer, q, k, v, window=window)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class GeGLU(GatedProjections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        gate, up = self.w_gate_up(x).split(self.intermediate_size, dim=-1)  # each [B, T, I]
        return self.w_down(F.gelu(gate, approximate="tanh") * up)


class Gemma3Layer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.attn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.attn = Gemma3Attention(config)
        self.post_attn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.ffn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.ffn = GeGLU(config)
        self.post_ffn_norm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, x, cos, sin, layer, context, window: SlidingWindow | None = None):  # x: [B, T, D] -> [B, T, D]
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, layer, context, window))
        return x + self.post_ffn_norm(self.ffn(self.ffn_norm(x)))


def local_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies of the sliding layers (their own base, no scaling), on the CPU."""
    assert config.gemma3 is not None
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim
    return (1.0 / (config.gemma3.rope_local_theta ** exponents)).float()


def scaled_embeddings(x: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """x [B, T, D] times sqrt(D), the factor rounded to x's dtype first (from fp32, as transformers does)."""
    return x * torch.tensor(math.sqrt(hidden_size), dtype=torch.float32).to(x.dtype)


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final_logit_softcapping), or the logits as they are without a cap."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
