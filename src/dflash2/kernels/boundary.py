"""Checks at the Python boundary of the C++ kernels: what a kernel reads through raw pointers must have the dtype,
contiguity and element count its layout needs, checked once when the layer is built (the model store's caches hand
these tensors over from files; a mismatch would read past a tensor's memory instead of failing).

The C++ side checks the same things per call (``TORCH_CHECK`` in ``gemm_gguf_avx2.cpp``); this one names the layer
and fails before any C++ object holds the tensors.
"""

from __future__ import annotations

import torch

__all__ = ["KernelInputError", "check_packed_blocks", "check_quant_panels", "check_tensor"]

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
