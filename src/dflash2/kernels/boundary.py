"""Checks at the Python boundary of the C++ kernels: what a kernel reads through raw pointers must have the dtype,
contiguity and element count its layout needs. Weights (GGUF runs, int8 / int4 and bf16 panels) are checked once when
the layer is built (the model store's caches hand these tensors over from files; a mismatch would read past a
tensor's memory instead of failing); the activations of the layer ops and the attention kernel on every call, with
attribute reads only (no tensor op, no allocation: these calls sit on the per-token path).

The C++ side checks most of the same things per call (``TORCH_CHECK``), but not all (a zero head count or width
divides by zero there) and as a RuntimeError without the argument's name; these name the kernel and the argument
and fail before any C++ code runs.
"""

from __future__ import annotations

import math

import torch

__all__ = ["KernelInputError", "check_attention", "check_packed_bf16", "check_packed_blocks", "check_qkv_rope",
           "check_quant_panels", "check_rms_norm", "check_silu_mul", "check_tensor", "qkv_rope_problem",
           "rms_norm_problem", "silu_mul_problem"]

_GGUF_PANEL = 8  # outputs per panel of the gguf kernels (kPanel in gemm_gguf_avx2.cpp)


class KernelInputError(ValueError):
    """A tensor handed to a C++ kernel that does not fit its layout (one line)."""


def check_tensor(name: str, tensor: torch.Tensor | None, dtype: torch.dtype, numel: int, where: str) -> None:
    """``tensor``: a contiguous CPU tensor of ``dtype`` with ``numel`` elements."""
    if tensor is None:
        raise KernelInputError(f"{where}: {name} is missing")
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.numel() != numel:
        raise KernelInputError(f"{where}: {name} is {tensor.dtype} {list(tensor.shape)} on {tensor.device} "
                               f"(contiguous: {tensor.is_contiguous()}); the kernel needs a contiguous CPU {dtype} "
                               f"tensor of {numel} elements")


def check_packed_blocks(pb, where: str = "gguf layer") -> None:
    """A :class:`~dflash2.kernels.gguf_packing.PackedBlocks` run fits the layout its fields describe: P panels of 8
    outputs, B blocks of 32 inputs, the codes' planes, one scale (and offset) per group of blocks, sub-scales."""
    if pb.weight.dim() != 4 or pb.weight.shape[3] != 32:
        raise KernelInputError(f"{where}: weight is {list(pb.weight.shape)}, expected [P, B, planes, 32]")
    p, b = int(pb.weight.shape[0]), int(pb.weight.shape[1])
    if not (pb.bits == 8 if pb.signed else 4 <= pb.bits <= 6):
        raise KernelInputError(f"{where}: {pb.bits}-bit {'signed' if pb.signed else 'unsigned'} codes are not a "
                               "kernel layout")
    if not (p >= 1 and b >= 1 and (p - 1) * _GGUF_PANEL < pb.out_features <= p * _GGUF_PANEL):
        raise KernelInputError(f"{where}: {pb.out_features} outputs do not fill {p} panels of {_GGUF_PANEL}")
    if pb.group < 1 or b % pb.group or pb.zero not in (0, 8, 16, 32):
        raise KernelInputError(f"{where}: group {pb.group} / zero point {pb.zero} do not fit {b} blocks")
    check_tensor("weight", pb.weight, torch.uint8, p * b * pb.bits * 32, where)
    groups = p * (b // pb.group) * _GGUF_PANEL
    check_tensor("scale", pb.scale, torch.float32, groups, where)
    if pb.offset is not None:
        check_tensor("offset", pb.offset, torch.float32, groups, where)
    if pb.sub_scales is not None:
        if pb.sub not in (16, 32):
            raise KernelInputError(f"{where}: sub-blocks of {pb.sub} inputs are not a kernel layout")
        check_tensor("sub_scales", pb.sub_scales, torch.int8, p * b * (32 // pb.sub) * _GGUF_PANEL, where)
    if pb.offset_mult is not None:
        if pb.offset is None:
            raise KernelInputError(f"{where}: offset multipliers come without an offset")
        check_tensor("offset_mult", pb.offset_mult, torch.int8, p * b * _GGUF_PANEL, where)


_QUANT_PANEL = 16  # outputs per panel of the int8 / int4 kernels (kPanel in gemm_quant_avx2.cpp)


def check_quant_panels(weights: str, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, k: int, n: int,
                       where: str = "quantized layer") -> None:
    """The AVX2 int8 / int4 kernels' panels for an [n, k] layer: int8 [P, K, 16] with fp32 [N] scales, or int4 uint8
    [P, K/2, 16] with fp32 [P, K/32, 16] scales (P = ceil(N / 16)); an fp32 [N] bias or none."""
    p = -(-n // _QUANT_PANEL)
    if k < 1 or n < 1 or (weights == "int4" and k % 32):
        raise KernelInputError(f"{where}: a [{n}, {k}] layer has no {weights} kernel layout")
    if weights == "int8":
        check_tensor("weight", q, torch.int8, p * k * _QUANT_PANEL, where)
        check_tensor("scale", scale, torch.float32, n, where)
    else:
        check_tensor("weight", q, torch.uint8, p * (k // 2) * _QUANT_PANEL, where)
        check_tensor("scale", scale, torch.float32, p * (k // 32) * _QUANT_PANEL, where)
    if bias is not None:
        check_tensor("bias", bias, torch.float32, n, where)


_BF16_PANEL = 16  # outputs per panel of the packed bf16 kernel (kPanel in gemm_avx2.cpp, gemm_amx.cpp)
_TILE_STEP = 32  # inputs per k step of the tile layout (kStep in gemm_amx.cpp, gemm_dpbf16.cpp)


def check_packed_bf16(tiles: bool, weight: torch.Tensor, bias: torch.Tensor | None, k: int, n: int,
                      where: str = "bf16 layer") -> None:
    """The bf16 panels of an [n, k] layer: [P, K, 16] for the AVX2 kernel, or [P, ceil(K/32), 16, 32] for the tile
    layout (AMX, AVX512-BF16), P = ceil(N / 16), contiguous bf16; an fp32 [N] bias or none."""
    p = -(-n // _BF16_PANEL)
    shape = (p, -(-k // _TILE_STEP), _BF16_PANEL, _TILE_STEP) if tiles else (p, k, _BF16_PANEL)
    check_tensor("weight", weight, torch.bfloat16, math.prod(shape), where)
    if weight.shape != shape:  # the kernels take K and the panel count from the weight's dimensions
        raise KernelInputError(f"{where}: weight is {list(weight.shape)}, the kernel needs {list(shape)}")
    if bias is not None:
        check_tensor("bias", bias, torch.float32, n, where)


# Per-call checks of the layer ops and the attention kernel. Strides other than the last dimension's are free: the
# layer ops copy a non-contiguous input into a contiguous one and attention reads each tensor through its own strides
# (its wrapper makes the last dimension contiguous), so what can go wrong is the dtype, the device, the number of
# dimensions and the sizes that must agree between arguments.

_LAYER_DTYPES = (torch.float32, torch.bfloat16)
_ATTENTION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is(t: torch.Tensor) -> str:
    return f"is {t.dtype} {list(t.shape)} on {t.device}"


def rms_norm_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``rms_norm`` cannot take these arguments, or None: x [..., D] fp32 / bf16 on the CPU, D a positive
    multiple of 8; weight [D] of x's dtype."""
    if x.dtype not in _LAYER_DTYPES or not x.is_cpu or x.dim() == 0:
        return f"rms_norm: x {_is(x)}; the kernel takes an fp32 or bf16 CPU [..., D] tensor"
    d = x.shape[-1]
    if d == 0 or d % 8:  # (D = 0 divides by zero in the C++ work split)
        return f"rms_norm: x {_is(x)}; D (its last dimension) must be a positive multiple of 8"
    if weight.dtype != x.dtype or not weight.is_cpu or weight.shape != (d,):
        return f"rms_norm: weight {_is(weight)}; the kernel needs a CPU {x.dtype} [{d}] tensor (x is {list(x.shape)})"
    return None


def qkv_rope_problem(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
                     ) -> str | None:
    """Why ``qkv_rope`` cannot take these arguments, or None: qkv [B, T, (H + 2 Hkv) Dh] fp32 / bf16 on the CPU, cos
    and sin [B or 1, 1, T, Dh] of its dtype (Dh positive and even), H and Hkv positive."""
    if qkv.dtype not in _LAYER_DTYPES or not qkv.is_cpu or qkv.dim() != 3:
        return f"qkv_rope: qkv {_is(qkv)}; the kernel takes an fp32 or bf16 CPU [B, T, W] tensor"
    if cos.dtype != qkv.dtype or not cos.is_cpu or cos.dim() != 4:
        return f"qkv_rope: cos {_is(cos)}; the kernel needs a CPU {qkv.dtype} [B or 1, 1, T, Dh] tensor"
    if sin.dtype != qkv.dtype or not sin.is_cpu or sin.shape != cos.shape:
        return (f"qkv_rope: sin {_is(sin)}; the kernel needs cos's dtype, device and shape ({qkv.dtype} "
                f"{list(cos.shape)} on cpu)")
    batch, tokens, width = qkv.shape
    rows, one, angles, dh = cos.shape
    if rows not in (1, batch) or one != 1 or angles != tokens or dh == 0 or dh % 2:
        return (f"qkv_rope: cos / sin are {list(cos.shape)}; the kernel needs [{batch} or 1, 1, {tokens}, Dh] (Dh "
                f"positive and even) for qkv {list(qkv.shape)}")
    if heads < 1 or kv_heads < 1 or width != (heads + 2 * kv_heads) * dh:
        return (f"qkv_rope: heads {heads} / kv_heads {kv_heads} (both positive) do not split qkv's {width} columns "
                f"into (H + 2 Hkv) heads of {dh}")
    return None


def silu_mul_problem(gate_up: torch.Tensor, lanes: int = 0) -> str | None:
    """Why ``silu_mul`` cannot take these arguments, or None: gate_up [..., 2I] fp32 / bf16 on the CPU, I a multiple
    of 8; lanes 0, 8 or 16."""
    if gate_up.dtype not in _LAYER_DTYPES or not gate_up.is_cpu or gate_up.dim() == 0 or gate_up.shape[-1] % 16:
        return (f"silu_mul: gate_up {_is(gate_up)}; the kernel takes an fp32 or bf16 CPU [..., 2I] tensor, I a "
                "multiple of 8")
    if lanes not in (0, 8, 16):
        return f"silu_mul: lanes is {lanes}; the kernel takes 0, 8 or 16"
    return None


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Raise :class:`KernelInputError` with :func:`rms_norm_problem`'s reason, if any."""
    _raise_if(rms_norm_problem(x, weight))


def check_qkv_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int) -> None:
    """Raise :class:`KernelInputError` with :func:`qkv_rope_problem`'s reason, if any."""
    _raise_if(qkv_rope_problem(qkv, cos, sin, heads, kv_heads))


def check_silu_mul(gate_up: torch.Tensor, lanes: int) -> None:
    """Raise :class:`KernelInputError` with :func:`silu_mul_problem`'s reason, if any."""
    _raise_if(silu_mul_problem(gate_up, lanes))


def _raise_if(problem: str | None) -> None:
    if problem is not None:
        raise KernelInputError(problem)


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None) -> None:
    """``invariant_attention``: q [B, H, T, Dh], k and v [B, Hkv, S, Dh] of one dtype (fp32, bf16, fp16) on the CPU,
    Dh a positive multiple of 8, Hkv positive and dividing H; a bool mask [B or 1, 1, T or 1, S] or none."""
    if q.dtype not in _ATTENTION_DTYPES or not q.is_cpu or q.dim() != 4:
        raise KernelInputError(f"attention: q {_is(q)}; the kernel takes an fp32, bf16 or fp16 CPU [B, H, T, Dh] "
                               "tensor")
    if k.dtype != q.dtype or not k.is_cpu or k.dim() != 4:
        raise KernelInputError(f"attention: k {_is(k)}; the kernel needs a CPU {q.dtype} [B, Hkv, S, Dh] tensor")
    if v.dtype != q.dtype or not v.is_cpu or v.shape != k.shape:
        raise KernelInputError(f"attention: v {_is(v)}; the kernel needs k's dtype, device and shape "
                               f"({q.dtype} {list(k.shape)} on cpu)")
    batch, heads, tokens, dh = q.shape
    kv_batch, kv_heads, slots, kv_dh = k.shape
    if dh == 0 or dh % 8:
        raise KernelInputError(f"attention: q {_is(q)}; its head dim must be a positive multiple of 8")
    # (Hkv = 0 divides by zero in the C++ head grouping; slot indices are 32-bit there)
    if kv_batch != batch or kv_dh != dh or kv_heads == 0 or heads % kv_heads or slots >= 1 << 31:
        raise KernelInputError(f"attention: k / v are {list(k.shape)}; the kernel needs [{batch}, Hkv, S, {dh}] "
                               f"with Hkv dividing {heads} (q is {list(q.shape)})")
    if attn_mask is not None:
        if attn_mask.dtype != torch.bool or not attn_mask.is_cpu or attn_mask.dim() != 4:
            raise KernelInputError(f"attention: attn_mask {_is(attn_mask)}; the kernel needs a CPU bool "
                                   "[B or 1, 1, T or 1, S] tensor")
        mask_batch, mask_heads, mask_tokens, mask_slots = attn_mask.shape
        if mask_batch not in (1, batch) or mask_heads != 1 or mask_tokens not in (1, tokens) or mask_slots != slots:
            raise KernelInputError(f"attention: attn_mask is {list(attn_mask.shape)}; the kernel needs [{batch} or 1, "
                                   f"1, {tokens} or 1, {slots}]")
