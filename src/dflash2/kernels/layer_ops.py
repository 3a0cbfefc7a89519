"""One-call CPU kernels for the decoder's small per-layer operations (``layer_ops.cpp``): RMSNorm, the split of
the fused q/k/v projection into heads with the rotary embedding applied, and the feed-forward's SiLU(gate) * up.

Why: at one row (plain decoding, a short verification block) these operations cost next to nothing to compute but
5-14 PyTorch operations each, and each operation costs microseconds of dispatch: measured on a 2-core AMD EPYC
Zen 3, one row of the 1.5B target (bf16), an RMSNorm module call took 70 us and the q/k/v split + rotary embedding
44 us, about 0.2 ms per layer in all (docs/kernels.md). Here each is one call.

What they compute (details in the C++ file): the rotary embedding bit for bit as PyTorch's ``q * cos +
rotate_half(q) * sin`` in the model's dtype; RMSNorm as HF's Qwen2 / Llama RMSNorm with the sum of squares of a row
in one fixed order of its own (so not always PyTorch's last bit, but a row's result never depends on the other rows:
verification stays row-count invariant); SiLU(gate) * up as PyTorch's ``F.silu(gate) * up`` rounds it, with an exp of
its own (within ~2 ulp of fp32 before the rounding; the same bits on every machine). At 9 rows of the 1.5B target the
SiLU and product cost ~1.9 ms per step as two PyTorch operations on the Intel Xeon (AMX). Used by
:mod:`dflash2.models.decoder` on CPU for fp32 / bf16 inference (no autograd); ``DFLASH2_LAYER_OPS=torch`` (or ``DFLASH2_KERNELS=off``, or a CPU without AVX2 / FMA) keeps the
PyTorch operations. Built on first use like the other kernels (:mod:`dflash2.kernels.jit`) and self-checked.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash2 import platform
from dflash2.kernels import jit
from dflash2.kernels.boundary import (check_qkv_rope, check_rms_norm, check_silu_mul, qkv_rope_problem,
                                     rms_norm_problem, silu_mul_problem)

__all__ = ["ENV", "apply_rope", "layer_ops_available", "layer_ops_status", "qkv_rope", "reference_qkv_rope",
           "reference_rms_norm", "reference_silu_mul", "rms_norm", "rotate_half", "run_qkv_rope", "run_rms_norm",
           "run_silu_mul", "silu_mul", "use_layer_ops"]

ENV = "DFLASH2_LAYER_OPS"
_SOURCE = Path(__file__).with_name("layer_ops.cpp")
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm in PyTorch operations (the decoder's path without the kernel)."""
    x_f32 = x.float()
    normed = x_f32 * torch.rsqrt(x_f32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def reference_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2 Hkv) Dh], cos / sin [B or 1, 1, T, Dh] -> q [B, H, T, Dh], k / v [B, Hkv, T, Dh]."""
    batch, seq, _ = qkv.shape
    head_dim = cos.shape[-1]
    q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
    k = k.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> F.silu(gate) * up [..., I] in PyTorch operations (the decoder's path without the kernel)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of the half-split layout: x [..., Dh] with cos / sin broadcast to it."""
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # x: [..., Dh]: (x1, x2) -> (-x2, x1)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _self_check(ops) -> str:
    """The rotary embedding bit for bit against the PyTorch operations; RMSNorm and SiLU * up to the dtype's last
    bits, and a row of a 5-row call bitwise the row alone."""
    rms, rope, silu_mul_op = ops
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for batch, shared in ((1, True), (2, False), (2, True)):
            qkv = torch.randn(batch, 3, (4 + 2 * 2) * 16, generator=g).to(dtype)
            angles = torch.randn(1 if shared else batch, 1, 3, 16, generator=g)
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            got, ref = rope(qkv, cos, sin, 4, 2), reference_qkv_rope(qkv, cos, sin, 4, 2)
            if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                return f"qkv_rope self-check failed ({dtype}, B={batch})"
        x = (torch.randn(5, 64, generator=g) * 3).to(dtype)
        w = torch.randn(64, generator=g).to(dtype)
        got, ref = rms(x, w, 1e-6), reference_rms_norm(x, w, 1e-6)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        if not torch.allclose(got.float(), ref.float(), rtol=tolerance, atol=tolerance):
            return f"rms_norm self-check failed ({dtype}, max abs err {(got.float() - ref.float()).abs().max():.3g})"
        if not torch.equal(rms(x[2:3].contiguous(), w, 1e-6), got[2:3]):
            return f"rms_norm self-check failed ({dtype}): a row of 5 differs from the row alone"
        gu = (torch.randn(5, 2, 48, generator=g) * 4).to(dtype)
        got, ref = silu_mul_op(gu), reference_silu_mul(gu)
        if not torch.allclose(got.float(), ref.float(), rtol=tolerance, atol=tolerance):
            return f"silu_mul self-check failed ({dtype}, max abs err {(got.float() - ref.float()).abs().max():.3g})"
        if not torch.equal(silu_mul_op(gu[2:3].contiguous()), got[2:3]):
            return f"silu_mul self-check failed ({dtype}): a row of 5 differs from the row alone"
    return ""


def _load() -> tuple[bool, str, object]:
    ok, status, op = jit.jit_load("layer-ops", "dflash2_layer_ops", _SOURCE, _CFLAGS, "dflash2_layer_ops.rms_norm",
                                  lambda op: _self_check(_ops(op)), label="layer ops AVX2/FMA ")
    return ok, status, _ops(op) if ok else None


def _ops(rms_op) -> tuple[object, object, object] | None:
    if rms_op is None:
        return None
    return rms_op, torch.ops.dflash2_layer_ops.qkv_rope.default, torch.ops.dflash2_layer_ops.silu_mul.default


def layer_ops_available() -> bool:
    """True when the kernels are built, loaded and passed their self-check (the first call builds them)."""
    jit.ensure_loaded(_state, _lock, _load, "layer ops kernel")
    return bool(_state["available"])


def layer_ops_status() -> str:
    jit.ensure_loaded(_state, _lock, _load, "layer ops kernel")
    return str(_state["status"])


def use_layer_ops(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    """The decoder may call the kernels for ``x`` (and ``weight``): CPU, fp32 / bf16, no gradient wanted through
    either (the kernels have no backward), not switched off (``DFLASH2_LAYER_OPS=torch``, parsed once:
    :func:`dflash2.platform.reload_settings` after changing it), kernels available."""
    if x.device.type != "cpu" or x.dtype not in DTYPES:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
        return False
    return not platform.settings().layer_ops.off and layer_ops_available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (D a multiple of 8), weight [D] of x's dtype -> [..., D] (see the module doc). Arguments the
    kernel does not take raise :class:`~dflash2.kernels.boundary.KernelInputError` (this and the two below)."""
    check_rms_norm(x, weight)
    return _state["op"][0](x, weight, eps)


def qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`reference_qkv_rope` in one call (bitwise the same; contiguous outputs)."""
    check_qkv_rope(qkv, cos, sin, heads, kv_heads)
    return _state["op"][1](qkv, cos, sin, heads, kv_heads)


def silu_mul(gate_up: torch.Tensor, lanes: int = 0) -> torch.Tensor:
    """gate_up [..., 2I] (I a multiple of 8) -> SiLU(gate) * up [..., I] in one call (see the module doc); ``lanes``
    16 (AVX-512) or 8 (AVX2) picks the vector width (default: the widest here), the same bits either way."""
    check_silu_mul(gate_up, lanes)
    return _state["op"][2](gate_up, lanes)


# The decoder's entry points: the kernel where it may run (use_layer_ops and the shapes it takes), else the PyTorch
# operations; the same bits either way for the rotary embedding, the same math for the others. The decoder calls
# these and never asks about the kernels or the CPU itself.


def run_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> RMSNorm(x) [..., D]: :func:`rms_norm` (D a multiple of 8, weight in x's dtype) or
    :func:`reference_rms_norm`."""
    if use_layer_ops(x, weight) and rms_norm_problem(x, weight) is None:
        return _state["op"][0](x, weight, eps)
    return reference_rms_norm(x, weight, eps)


def run_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, T, (H + 2 Hkv) Dh], cos / sin [B or 1, 1, T, Dh] -> q [B, H, T, Dh], k / v [B, Hkv, T, Dh] rotated:
    :func:`qkv_rope` (tables in qkv's dtype) or :func:`reference_qkv_rope`."""
    if use_layer_ops(qkv) and qkv_rope_problem(qkv, cos, sin, heads, kv_heads) is None:
        return _state["op"][1](qkv, cos, sin, heads, kv_heads)
    return reference_qkv_rope(qkv, cos, sin, heads, kv_heads)


def run_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> SiLU(gate) * up [..., I]: :func:`silu_mul` (I a multiple of 8) or
    :func:`reference_silu_mul`."""
    if use_layer_ops(gate_up) and silu_mul_problem(gate_up) is None:
        return _state["op"][2](gate_up, 0)
    return reference_silu_mul(gate_up)
