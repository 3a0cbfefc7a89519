"""A decoder layer over GGUF blocks in one C++ call (``gguf_layer.h``, built into the gguf kernel).

Why: at one row the 1.5B target's 28 layers spend ~6 ms per step outside the matrix products (measured on 2 Zen 4
cores with every ``GgufLinear`` replaced by a constant: 6-8 ms of a 40-50 ms step), almost all of it ~25 Python
round trips per layer (module calls, checks, views, small ops of a few microseconds each). ``gguf_layer`` makes the
same calls in the same order from C++ (the layer ops, the gguf linears, the cache write, the row-invariant
attention), so its output is the Python layer's bit for bit (tested) and speculation stays exactly lossless.

It runs where the Python layer would take exactly those kernels: a request's static KV cache, causal (plain decoding,
chain verification, prefill) or with an explicit bool mask the attention kernel takes (tree verification: the mask
handed to the kernel as ``invariant_attention`` hands it, with the same causal flag), or several requests' caches,
causal, one per segment of the token axis (``gguf_layer_segments``: the batch engine's shared draft pass), every
projection a ``GgufLinear`` on a kernel backend, fp32 / bf16 inference, the layer ops and the attention kernel on.
Elsewhere (masks over several segments, a mask the kernel would refuse, sliding windows, the batch engine's paged
cache, autograd, ``DFLASH2_GGUF_LAYER=off``) the decoder runs its Python layer.
"""

from __future__ import annotations

from typing import Callable

import torch

from dflash2 import platform
from dflash2.kernels import gguf_linear as _gguf
from dflash2.kernels import jit
from dflash2.kernels import layer_ops
from dflash2.kernels.attention import attention_kernel_available, kernel_mask, use_invariant_kernel

ENV = "DFLASH2_GGUF_LAYER"

LayerRunner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]  # (x, cos, sin, layer) -> x


def fused_layers(model, context, x: torch.Tensor) -> LayerRunner | None:
    """A function running layer ``i`` of ``model`` in one call for this forward, or None where the Python layers
    must run (see the module doc). ``context`` is the forward's attention context, ``x`` its embeddings [B, T, D]:
    one request's cache (``CachedAttention``, causal or with a tree's mask), or several requests' caches, one per
    segment of the token axis (``SegmentedAttention``: the shared draft pass of the batch engine)."""
    config = model.config
    if not _switched_on() or x.device.type != "cpu" or x.dtype not in layer_ops.DTYPES or config.head_dim % 8 \
            or config.hidden_size % 8 or config.intermediate_size % 8:  # (the layer ops' and attention's conditions)
        return None
    parts = getattr(context, "parts", None)  # SegmentedAttention: one CachedAttention per segment
    if parts is not None:
        return _segmented_layers(model, parts, context.lengths, x)
    cache = getattr(context, "cache", None)
    if cache is None or not hasattr(context, "mask"):
        return None
    mask = None
    if context.mask is not None:
        mask = _kernel_mask(context.mask, x, cache.length)
        if mask is None:
            return None
    layers = _usable_layers(model, [cache], x)
    if layers is None:
        return None
    op, _, handles = layers
    length, keys, values = cache.length, cache.keys, cache.values  # [L, B, H_kv, S, Dh]

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int) -> torch.Tensor:
        with jit.no_torch_function():  # (the layer handle is a C++ object: jit.no_torch_function)
            return op(x, cos, sin, keys[index], values[index], length, handles[index], mask)

    return run


def _kernel_mask(mask: torch.Tensor, x: torch.Tensor, length: int) -> torch.Tensor | None:
    """``CachedAttention``'s mask [B or 1, 1, T or 1, S] as ``invariant_attention`` hands it to the kernel ([B or 1,
    T or 1, S], the last axis contiguous), made once per forward; None where the Python layer would not give this
    mask to the kernel as it is (not bool: PyTorch's attention; a shape the kernel refuses: its error)."""
    batch, seq = x.shape[:2]
    if mask.dtype != torch.bool or mask.device.type != "cpu" or mask.dim() != 4:
        return None
    mask_batch, mask_heads, mask_tokens, mask_slots = mask.shape
    if mask_batch not in (1, batch) or mask_heads != 1 or mask_tokens not in (1, seq) or mask_slots != length + seq:
        return None
    return kernel_mask(mask)


def _segmented_layers(model, parts: list, lengths: list[int], x: torch.Tensor) -> LayerRunner | None:
    """Layer ``i`` over every segment's tokens in one call (``gguf_layer_segments``): each segment (``parts``: its
    ``CachedAttention``, ``lengths``: its token count) writes and attends to its own cache as ``CachedAttention``
    would, the linear layers run once over all rows."""
    caches = [part.cache for part in parts]
    if x.shape[0] != 1 or any(c is None for c in caches) or any(part.mask is not None for part in parts):
        return None
    layers = _usable_layers(model, caches, x)
    if layers is None:
        return None
    _, op, handles = layers
    cached, seq = [c.length for c in caches], list(lengths)

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int) -> torch.Tensor:
        keys = [c.keys[index] for c in caches]  # each [1, H_kv, S_i, Dh]
        values = [c.values[index] for c in caches]
        with jit.no_torch_function():
            return op(x, cos, sin, keys, values, cached, seq, handles[index])

    return run


def _usable_layers(model, caches: list, x: torch.Tensor) -> tuple[object, object, list] | None:
    """(gguf_layer op, gguf_layer_segments op, per-layer handles) where the fused layers may run over these caches,
    else None."""
    if torch.is_grad_enabled() or any(cache.keys.dtype != x.dtype for cache in caches):
        return None
    layers = _layer_handles(model)
    if layers is None or not layer_ops.use_layer_ops(x) or not use_invariant_kernel() \
            or not attention_kernel_available():
        return None
    return layers


def _switched_on() -> bool:
    return not platform.settings().gguf_layer.off


def _layer_handles(model) -> tuple[object, object, list] | None:
    """(gguf_layer op, gguf_layer_segments op, one GgufLayer per decoder layer), built once per model; None when a
    layer is not all GgufLinear on one kernel backend, or a norm's weight is not in the model dtype."""
    cached = getattr(model, "_gguf_layers", False)
    if cached is not False:
        return cached
    result = _build_handles(model)
    model._gguf_layers = result  # a plain attribute: not a module, parameter or buffer
    return result


def _build_handles(model) -> tuple[object, object, list] | None:
    projections = [(layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down) for layer in model.layers]
    backends = {p.backend if isinstance(p, _gguf.GgufLinear) else None for ps in projections for p in ps}
    if len(backends) != 1 or not set(backends) <= set(_gguf.kernel_backends()):
        return None
    norms = [(layer.attn_norm, layer.ffn_norm) for layer in model.layers]
    if any(n.weight.dtype != model.dtype or n.eps != a.eps for a, f in norms for n in (a, f)):
        return None
    backend = backends.pop()
    namespace = _gguf.build_namespace(backend)
    handles = []
    for layer, linears in zip(model.layers, projections):
        handle = getattr(torch.classes, namespace).GgufLayer()
        handle.set(layer.attn_norm.weight.detach(), layer.ffn_norm.weight.detach(), float(layer.attn_norm.eps),
                   *(linear.cpp_weights() for linear in linears), layer.attn.num_heads, layer.attn.num_kv_heads)
        handles.append(handle)
    ops = getattr(torch.ops, namespace)
    return ops.gguf_layer.default, ops.gguf_layer_segments.default, handles


__all__ = ["ENV", "fused_layers"]
