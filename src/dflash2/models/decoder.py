"""A lean decoder for the Llama / Qwen2 / Qwen3 family and Gemma 3, written for this engine.

RMSNorm, rotary embeddings (the model's theta and scaling: Llama 3.x's llama3), grouped-query attention, SwiGLU,
q/k/v biases where Qwen2 has them, per-head q/k norms where Qwen3 has them, tied or untied head; Gemma 3's layers
(:mod:`dflash2.models.gemma3`: sliding-window layers, four norms, GeGLU) where the config has them. The forward pass
takes token ids, explicit positions, an optional explicit attention mask (tree verification) and a
:class:`~dflash2.kv.StaticKVCache`, and can return the hidden states of any layers (drafters read them). Device and
dtype are whatever the weights are on.

Linear layers are fused where the math allows it (q/k/v into one, gate/up into one): fewer, larger
matrix-vector products are what memory-bound decoding wants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol, Sequence

import torch
from torch import nn

from dflash2.kernels import layer_ops
from dflash2.kernels.gguf_layer import fused_layers
from dflash2.kv.static import StaticKVCache
from dflash2.models.attention import SlidingWindow, attend
from dflash2.models.config import ModelConfig
from dflash2.models.gemma3 import Gemma3Layer, GemmaRMSNorm, local_inverse_frequencies, scaled_embeddings, soft_capped
from dflash2.models.projections import AttentionProjections, GatedProjections

LogitsSelection = Literal["all", "last", "none"]


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T, V] ("all"), [B, 1, V] ("last") or None ("none"); float32
    hidden_states: tuple[torch.Tensor, ...]  # one [B, T, D] per requested layer, in the order requested


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        return layer_ops.run_rms_norm(x, self.weight, self.eps)  # one call where the kernel runs (kernels/layer_ops.py)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies on the CPU (whatever the default device: on the meta device the
    arithmetic would run through torch's Python references, which import torch._dynamo), the rope scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).float()
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling).float()
    raise ValueError(f"unsupported rope scaling {rope_type!r} (supported: linear, llama3)")


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [B, T] -> (cos, sin), each [B, 1, T, Dh] in ``dtype``: the angles in fp32 (as Hugging Face computes
    them), their cosine and sine in fp64 rounded to fp32, then to ``dtype``.

    fp64 because PyTorch's fp32 cosine on CPU was seen to give different last bits for the same angles from one
    process to the next (the first forward of about one process in four on the Intel Xeon (AMX)), which changed
    greedy outputs between runs; rounded from fp64, each value is the correctly rounded fp32 (but for ties far rarer
    than any such difference) whatever the kernel."""
    angles = positions.to(inv_freq.device).float()[..., None] * inv_freq  # [B, T, Dh / 2]
    angles = torch.cat((angles, angles), dim=-1)[:, None].double()  # [B, 1, T, Dh]
    return angles.cos().float().to(dtype), angles.sin().float().to(dtype)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, blended)
    return torch.where(wavelength < original / high, inv_freq, scaled)


class Attention(AttentionProjections):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # Qwen3: q and k normalised per head before RoPE (weights [Dh]); None elsewhere
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, D]
        cos: torch.Tensor,  # [B, 1, T, Dh]
        sin: torch.Tensor,  # [B, 1, T, Dh]
        layer: int,
        context: AttentionContext,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = self.wqkv(x)  # [B, T, (H + 2 H_kv) Dh]
        # q [B, H, T, Dh], k / v [B, H_kv, T, Dh]; q and k rotated (RoPE), in one call where the kernel runs
        if self.q_norm is None:
            q, k, v = layer_ops.run_qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        else:
            q, k, v = self._normed_qkv_rope(qkv, cos, sin)
        out = context.attend(layer, q, k, v)  # [B, H, T, Dh]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


    def _normed_qkv_rope(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Qwen3's order: split, RMSNorm each head's q and k, then RoPE; q [B, H, T, Dh], k / v [B, H_kv, T, Dh]."""
        batch, seq, _ = qkv.shape
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        q = self.q_norm(q.reshape(batch, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.reshape(batch, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return layer_ops.apply_rope(q, cos, sin), layer_ops.apply_rope(k, cos, sin), v


class AttentionContext(Protocol):
    """Where one forward's new keys/values go and which keys each query sees: the static cache of one request
    (:class:`CachedAttention`) or the paged pool of a ragged batch (``decode.ragged.RaggedAttention``). The
    decoder's forward (embedding, RoPE, layer loop, taps, logits) is the same for both."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: SlidingWindow | None = None) -> torch.Tensor:
        """q [B, H, T, Dh], new k / v [B, H_kv, T, Dh] (after RoPE) -> attention output [B, H, T, Dh]; ``window``:
        a sliding-window layer's limit, applied on top of the context's own mask (Gemma 3's local layers)."""

    def finish(self, num_tokens: int) -> None:
        """After the last layer: commit the forward's writes (a static cache advances its length)."""


class CachedAttention:
    """A request's :class:`StaticKVCache` (or no cache), with an explicit mask (trees) or a causal one."""

    def __init__(self, cache: StaticKVCache | None, mask: torch.Tensor | None) -> None:
        self.cache = cache
        self.mask = mask  # [B or 1, 1, T, S] bool, True = may attend; None = causal
        self._windowed: dict[tuple[int, int], torch.Tensor] = {}  # (S, window) -> mask: built once per forward

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: SlidingWindow | None = None) -> torch.Tensor:
        seq = q.shape[2]
        if self.cache is not None:
            k, v = self.cache.write(layer, k, v)  # [B, H_kv, S, Dh], S = cached + T
        if window is not None:
            return attend(q, k, v, self._window_mask(window, k.shape[2], q.device))
        mask = self.mask
        is_causal = mask is None and seq > 1 and k.shape[2] == seq
        if mask is None and seq > 1 and k.shape[2] > seq:
            mask = causal_mask(seq, k.shape[2], q.device)
        return attend(q, k, v, mask, is_causal)

    def _window_mask(self, window: SlidingWindow, slots: int, device: torch.device) -> torch.Tensor:
        """[B, 1, T, S]: the causal (or explicit tree) mask within the window. The cache's committed slots hold
        positions 0 .. S - T - 1 (slot = position); the new slots hold this forward's positions."""
        key = (slots, window.size)
        if key not in self._windowed:
            positions = window.positions  # [B, T]
            batch, seq = positions.shape
            base = self.mask if self.mask is not None else causal_mask(seq, slots, device)
            cached = torch.arange(slots - seq, device=device).expand(batch, slots - seq)
            self._windowed[key] = window.restrict(base, torch.cat((cached, positions.to(device)), dim=1))
        return self._windowed[key]

    def finish(self, num_tokens: int) -> None:
        if self.cache is not None:
            self.cache.advance(num_tokens)


class SegmentedAttention:
    """Several independent sequences in one forward: the [1, N] tokens are their new tokens one after another
    (``lengths``: T_i each, summing to N), each segment attending causally to its own :class:`StaticKVCache` (the
    draft caches of several requests sharing one network: the linear layers then read their weights once)."""

    def __init__(self, caches: Sequence[StaticKVCache], lengths: Sequence[int]) -> None:
        if len(caches) != len(lengths):
            raise ValueError(f"{len(caches)} caches for {len(lengths)} segments")
        self.parts = [CachedAttention(cache, None) for cache in caches]
        self.lengths = list(lengths)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               window: SlidingWindow | None = None) -> torch.Tensor:
        """q [1, H, N, Dh], k / v [1, H_kv, N, Dh] -> [1, H, N, Dh], each segment attended as if alone."""
        split = [t.split(self.lengths, dim=2) for t in (q, k, v)]
        windows: list[SlidingWindow | None] = [None] * len(self.parts)
        if window is not None:  # each segment's own query positions
            windows = [SlidingWindow(window.size, p) for p in window.positions.split(self.lengths, dim=1)]
        return torch.cat([part.attend(layer, *qkv, window=w)
                          for part, w, *qkv in zip(self.parts, windows, *split)], dim=2)

    def finish(self, num_tokens: int) -> None:
        for part, length in zip(self.parts, self.lengths):
            part.finish(length)


def causal_mask(num_queries: int, num_keys: int, device: torch.device | str) -> torch.Tensor:
    """[1, 1, T, S] bool: query i (at slot S - T + i) sees every slot up to and including its own."""
    query_slots = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    return (torch.arange(num_keys, device=device)[None, :] <= query_slots)[None, None]


class FeedForward(GatedProjections):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        gate_up = self.w_gate_up(x)  # [B, T, 2I]
        return self.w_down(layer_ops.run_silu_mul(gate_up))  # one call where the kernel runs (kernels/layer_ops.py)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = FeedForward(config)

    def forward(self, x, cos, sin, layer, context):  # x: [B, T, D] -> [B, T, D]
        x = x + self.attn(self.attn_norm(x), cos, sin, layer, context)
        return x + self.ffn(self.ffn_norm(x))


def float_outputs(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``head(h).float()``, in one pass where the head is a GGUF layer (GgufLinear.forward_float: the same values)."""
    forward_float = getattr(head, "forward_float", None)
    return forward_float(h) if forward_float is not None else head(h).float()


class Transformer(nn.Module):
    """The target (or a small independent drafter) model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built on the meta device (build_transformer: the weights come from a state dict), the embedding skips its
        # random initialisation: normal_'s meta kernel imports torch._dynamo, ~1.4 s at a process's first load.
        on_meta = torch.get_default_device().type == "meta"
        empty = torch.empty(config.vocab_size, config.hidden_size) if on_meta else None
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        gemma3 = config.gemma3 is not None
        self.layers = nn.ModuleList((Gemma3Layer if gemma3 else DecoderLayer)(config) for _ in range(config.num_layers))
        self.norm = (GemmaRMSNorm if gemma3 else RMSNorm)(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        # Gemma 3's sliding layers rotate with a base of their own; None elsewhere
        self.register_buffer("inv_freq_local", local_inverse_frequencies(config) if gemma3 else None,
                             persistent=False)

    def reset_rope(self, device: torch.device | str) -> None:
        """Recompute the RoPE buffers on ``device`` (a model built on the meta device has none to move)."""
        self.inv_freq = rope_inverse_frequencies(self.config).to(device)
        if self.config.gemma3 is not None:
            self.inv_freq_local = local_inverse_frequencies(self.config).to(device)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, capacity: int, batch_size: int = 1) -> StaticKVCache:
        c = self.config
        return StaticKVCache(
            c.num_layers, c.num_kv_heads, c.head_dim, capacity, batch_size=batch_size, dtype=self.dtype, device=self.device
        )

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, sin), each [B, 1, T, Dh] in the model dtype (:func:`rope_tables`)."""
        return rope_tables(positions, self.inv_freq, self.dtype)

    def float_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over normed states h [..., D] -> fp32 logits [..., V] (:func:`float_outputs`; Gemma's soft cap
        where the config has one)."""
        logits = float_outputs(self.lm_head, h)
        return logits if self.config.gemma3 is None else soft_capped(logits, self.config.gemma3.final_logit_softcapping)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor | None = None,  # [B, T] int64; default: cache.length + arange(T)
        cache: StaticKVCache | None = None,
        attn_mask: torch.Tensor | None = None,  # [B or 1, T, S] bool over the S = cache.length + T visible slots
        *,
        hidden_layers: Sequence[int] = (),  # return the output of these decoder layers (0-based)
        logits: LogitsSelection | torch.Tensor = "all",  # or [M] int64 token indices (batch of 1): [1, M, V]
        context: AttentionContext | None = None,  # default: CachedAttention(cache, attn_mask)
        input_offsets: torch.Tensor | None = None,  # [B, T, D] added to the token embeddings (a drafter's conditioning)
    ) -> ForwardOutput:
        if context is None:
            context = CachedAttention(cache, attn_mask[:, None] if attn_mask is not None else None)  # [B, 1, T, S]
        start = cache.length if cache is not None else 0
        seq = input_ids.shape[1]
        if positions is None:
            positions = torch.arange(start, start + seq, device=input_ids.device).expand(input_ids.shape[0], seq)
        cos, sin = self.rope(positions)
        wanted = set(hidden_layers)
        taps: dict[int, torch.Tensor] = {}
        x = self.embed(input_ids)  # [B, T, D]
        gemma3 = self.config.gemma3
        if gemma3 is not None:
            x = scaled_embeddings(x, self.config.hidden_size)
        if input_offsets is not None:
            x = x + input_offsets.to(x.dtype)
        # GGUF blocks: each layer in one C++ call (same bits), or None; that call has no q/k norms (nor Gemma's layer)
        fused = None if self.config.qk_norm or gemma3 is not None else fused_layers(self, context, x)
        if gemma3 is not None:  # the sliding layers: their own RoPE tables and the window
            local = rope_tables(positions, self.inv_freq_local, self.dtype)
            window = SlidingWindow(gemma3.sliding_window, positions)
        for index, layer in enumerate(self.layers):
            if gemma3 is not None:
                sliding = gemma3.is_sliding(index)
                x = layer(x, *(local if sliding else (cos, sin)), index, context, window if sliding else None)
            elif fused is not None:
                x = fused(x, cos, sin, index)
            else:
                x = layer(x, cos, sin, index, context)
            if index in wanted:
                taps[index] = x
        context.finish(seq)
        out_logits = None
        if isinstance(logits, torch.Tensor):
            out_logits = self.float_logits(self.norm(x[:, logits]))
        elif logits != "none":
            x = x[:, -1:] if logits == "last" else x
            out_logits = self.float_logits(self.norm(x))
        return ForwardOutput(logits=out_logits, hidden_states=tuple(taps[i] for i in hidden_layers))
