"""CPU linear layer over weight-only quantized weights (int8 / int4), backed by JIT-built AVX2/FMA kernels.

Format ``int8``: symmetric per-output-channel quantization, ``W[n, :] ~= scale[n] * Q[n, :]`` with
``Q`` int8 in [-127, 127] and ``scale[n] = max|W[n, :]| / 127`` (fp32); ``y = (x @ Q^T) * scale + bias``.
Format ``int4``: symmetric, one fp32 scale per output and group of 32 inputs, ``Q`` in [-7, 7]
(stored as 4-bit nibbles), ``scale[n, g] = max|W[n, 32g:32g+32]| / 7``; ``y = x @ (Q * scale)^T + bias``.
The kernels in ``gemm_quant_avx2.cpp`` read the packed panels once per call (int8: half the bytes of
bf16, int4: about 5/16) and convert them to fp32 in registers or in an L1 buffer.  Every output is one
in-order fp32 FMA chain over k, so the result for a row does not depend on how many rows are in the
call (speculative verification stays exactly lossless with respect to the quantized model).

The kernel is built like the bf16 one (:mod:`dflash2.kernels.packed_linear`: ninja + a C++
compiler, ``DFLASH2_KERNELS=off`` forces the fallback) but under its own extension name and a build
directory named after a hash of its source, so differently edited copies never share a build.  The
fallback (``F.linear`` over the int8 weight, or the int4 weight times its scales, converted to fp32
in chunks, then the same scale and bias) gives the same numbers up to the order of the fp32 sum; it is announced by one warning.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash2 import platform
from dflash2.kernels import amx, jit
from dflash2.kernels import packed_linear as _bf16
from dflash2.kernels.boundary import check_quant_panels

__all__ = ["QUANT_FORMATS", "QuantLinear", "quant_kernel_status", "quant_kernels_available", "quantize_int4",
           "quantize_int8", "pack_int4", "pack_int8"]

QUANT_FORMATS = ("int8", "int4")
PANEL = 16  # output features per packed panel (kPanel in gemm_quant_avx2.cpp)
GROUP = 32  # inputs per int4 scale
_SOURCE = Path(__file__).with_name("gemm_quant_avx2.cpp")
# -ffp-contract=off: the scale and the bias are two roundings, as in the fallback (no fused FMA).
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]

KERNEL = "avx2"
AMX = "amx"  # int8 only: Intel AMX tiles (kernels/amx.py), where the CPU has them
TORCH = "torch"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "available": bool, "status": str, "op": callable


# ----------------------------------------------------------------------------------------------
# Quantization and packing
# ----------------------------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (Q int8 [N, K], scale fp32 [N]), symmetric per output channel.

    ``Q = round(W / scale)`` (half to even) with ``scale = max|W[n]| / 127``; an all-zero row gets
    scale 0 and Q 0.  Works in row chunks so the only full-size allocation is Q.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    w = weight.detach().cpu()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    step = max(1, (1 << 22) // max(1, k))  # ~16 MB of fp32 per chunk
    for n0 in range(0, n, step):
        rows = w[n0 : n0 + step].float()  # [r, K]
        s = rows.abs().amax(dim=1) / 127.0  # [r]
        scale[n0 : n0 + step] = s
        q[n0 : n0 + step] = torch.round(rows / s.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    return q, scale


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [ceil(N/16), K, 16] panels: ``out[p, k, j] = Q[16p + j, k]`` (rows past N zero)."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    p = -(-n // PANEL)
    padded = q if n == p * PANEL else torch.cat([q, q.new_zeros(p * PANEL - n, k)])
    return padded.view(p, PANEL, k).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8` (exact)."""
    p, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(p * PANEL, k)[:out_features].clone()


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight (K a multiple of 32) -> (Q int8 [N, K] in [-7, 7], scales fp32 [N, K/32]).

    ``Q = round(W / scale)`` per group of 32 inputs with ``scale = max|W[n, group]| / 7``; an all-zero
    group gets scale 0 and Q 0.
    """
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        raise ValueError(f"int4 needs a 2-D [N, K] weight with K a multiple of {GROUP}, got {tuple(weight.shape)}")
    w = weight.detach().cpu()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP, dtype=torch.float32)
    step = max(1, (1 << 22) // k)  # ~16 MB of fp32 per chunk
    for n0 in range(0, n, step):
        rows = w[n0 : n0 + step].float().view(-1, k // GROUP, GROUP)  # [r, G, 32]
        s = rows.abs().amax(dim=2) / 7.0  # [r, G]
        scales[n0 : n0 + step] = s
        inv = s.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        q[n0 : n0 + step] = torch.round(rows / inv).clamp_(-7, 7).view(-1, k)
    return q, scales


def pack_int4(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [N, K] in [-8, 7], scales [N, K/32]) -> (uint8 [P, K/2, 16], fp32 [P, K/32, 16]).

    Byte (p, i, j) holds ``Q[16p + j, 2i] + 8`` in its low nibble and ``Q[16p + j, 2i + 1] + 8`` in its
    high nibble; ``scales_packed[p, g, j] = scales[16p + j, g]``.  Rows past N are zero (scale 0).
    """
    n, k = q.shape
    p = -(-n // PANEL)
    pad = p * PANEL - n
    q = torch.cat([q, q.new_zeros(pad, k)]) if pad else q
    scales = torch.cat([scales, scales.new_zeros(pad, scales.shape[1])]) if pad else scales
    nib = (q.to(torch.int16) + 8).to(torch.uint8).view(p, PANEL, k // 2, 2)  # [P, 16, K/2, 2]
    packed = (nib[..., 0] | (nib[..., 1] << 4)).transpose(1, 2).contiguous()  # [P, K/2, 16]
    return packed, scales.float().view(p, PANEL, -1).transpose(1, 2).contiguous()


def unpack_int4(packed: torch.Tensor, scales_packed: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_int4` (exact)."""
    p, half_k, _ = packed.shape
    nib = packed.transpose(1, 2)  # [P, 16, K/2]
    q = torch.stack([nib & 15, nib >> 4], dim=-1).to(torch.int8) - 8  # [P, 16, K/2, 2]
    q = q.reshape(p * PANEL, 2 * half_k)[:out_features].clone()
    return q, scales_packed.transpose(1, 2).reshape(p * PANEL, -1)[:out_features].clone()


# ----------------------------------------------------------------------------------------------
# Building / loading the kernel (once per process)
# ----------------------------------------------------------------------------------------------


def _self_check(op) -> str:
    """Compare both kernels with the fallback on small shapes that hit every code path."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((3, 24, 64), (1, 7, 32), (13, 70, 320)):
        w, x, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        for weights in QUANT_FORMATS:
            q, s = _QUANTIZE[weights](w)
            packed = _PACK[weights](q, s)
            got = getattr(torch.ops.dflash2_qkernels, f"{weights}_linear").default(x, *packed, b, n)
            bad = jit.self_check_mismatch(got, _FALLBACK[weights](x, q, s, b), k, f"{weights} ")
            if bad:
                return bad
    return ""


def _load() -> tuple[bool, str, object]:
    return jit.jit_load("q8", "dflash2_qkernels", _SOURCE, _CFLAGS, "dflash2_qkernels.int8_linear", _self_check,
                        label="int8/int4 AVX2/FMA ")


def _ensure_loaded() -> None:
    jit.ensure_loaded(_state, _lock, _load, "int8/int4 CPU linear kernel")


def quant_kernels_available() -> bool:
    """True when the int8/int4 kernels are built, loaded and passed its self-check (builds it on first call)."""
    _ensure_loaded()
    return bool(_state["available"])


def quant_kernel_status() -> str:
    """One line: where the int8/int4 kernels were loaded from, or why it is not available."""
    _ensure_loaded()
    return str(_state["status"])


# ----------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------


class QuantLinear(_bf16.CpuLinear):
    """Inference-only CPU replacement for ``nn.Linear`` with weight-only quantized weights (``weights``:
    "int8" or "int4", see the module docstring), fp32 math, output in ``x``'s dtype.

    Like :class:`~dflash2.kernels.PackedLinear`, the weights are plain attributes (``.to()`` and
    ``state_dict()`` leave them alone); export with :meth:`dequantized_weight`.  Backends: ``"avx2"``
    (packed panels, the kernel) or ``"torch"`` (Q int8 [N, K] and ``F.linear`` on fp32 chunks);
    ``backend=None`` picks ``"avx2"`` when the kernels are available.
    """

    flat_on_tiles = True  # int8 on AMX: widened to bf16 tiles (int4 has no AMX backend)

    def __init__(self, weights: str, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int, backend: str) -> None:
        super().__init__()
        if weights not in QUANT_FORMATS:
            raise ValueError(f"unknown quantized format {weights!r} (expected one of {', '.join(QUANT_FORMATS)})")
        _check_backend(weights, backend)
        if backend == KERNEL:  # the C++ kernel reads these panels through raw pointers
            check_quant_panels(weights, q, scale, bias, int(in_features), int(out_features))
        self.weights = weights
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.backend = backend
        # amx: int8 [P, K/32, 16, 32] tiles; avx2: int8 [P, K, 16] / int4 uint8 [P, K/2, 16] panels; torch: Q [N, K]
        self.weight_data = q
        # int8: fp32 [N]; int4: fp32 [P, K/32, 16] (avx2) or [N, K/32] (torch)
        self.scale_data = scale
        self.bias_data = bias  # fp32 [N] or None
        self._op = getattr(torch.ops.dflash2_qkernels, f"{weights}_linear").default if backend == KERNEL else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, weights: str = "int8", backend: str | None = None) -> "QuantLinear":
        return cls.from_weight(linear.weight, linear.bias, weights=weights, backend=backend)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, weights: str = "int8",
                    backend: str | None = None) -> "QuantLinear":
        """Quantize a raw [N, K] weight (any float dtype) and keep an optional [N] bias in fp32."""
        if weights not in QUANT_FORMATS:
            raise ValueError(f"unknown quantized format {weights!r} (expected one of {', '.join(QUANT_FORMATS)})")
        if backend is None:
            backend = default_quant_backend(weights)
        _check_backend(weights, backend)
        n, k = weight.shape
        q, scale = _QUANTIZE[weights](weight)
        b = None
        if bias is not None:
            b = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if b.shape != (n,):
                raise ValueError(f"bias shape {tuple(b.shape)} != ({n},)")
        return cls(weights, *pack_for_backend(weights, backend, q, scale), b, k, n, backend)

    def quantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(Q int8 [N, K], scale: int8 fp32 [N] / int4 fp32 [N, K/32]) as new tensors."""
        if self.backend == TORCH:
            return self.weight_data.clone(), self.scale_data.clone()
        if self.backend == AMX:
            return amx.unpack_int8_amx(self.weight_data, self.out_features, self.in_features), self.scale_data.clone()
        if self.weights == "int8":
            return unpack_int8(self.weight_data, self.out_features), self.scale_data.clone()
        return unpack_int4(self.weight_data, self.scale_data, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the layer multiplies by, fp32 [out_features, in_features]."""
        q, scale = self.quantized()
        return q.float() * (scale[:, None] if self.weights == "int8" else scale.repeat_interleave(GROUP, dim=1))

    def kernel_rows(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        if self.backend == AMX:
            return amx.amx_int8_rows(x, self.weight_data, self.scale_data, self.bias_data, self.out_features,
                                     bf16_out)
        return self._op(x, self.weight_data, self.scale_data, self.bias_data, self.out_features)

    def fallback_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _FALLBACK[self.weights](x, self.weight_data, self.scale_data, self.bias_data)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_data is not None}, weights={self.weights}, backend={self.backend}")



def default_quant_backend(weights: str) -> str:
    """``amx`` for int8 where the CPU has AMX-BF16, else ``avx2`` when the kernels built, else ``torch``
    (:func:`dflash2.platform.choose_backend`)."""
    usable = {AMX: _bf16.amx_usable, KERNEL: quant_kernels_available}
    return platform.choose_backend(weights, lambda backend: usable[backend]())


def _check_backend(weights: str, backend: str) -> None:
    if backend not in (AMX, KERNEL, TORCH):
        raise ValueError(f"unknown backend {backend!r} (expected {AMX!r}, {KERNEL!r} or {TORCH!r})")
    if backend == KERNEL and not quant_kernels_available():
        raise RuntimeError(f"dflash2 quantized kernel backend requested but unavailable: {quant_kernel_status()}")
    if backend == AMX:
        if weights != "int8":
            raise ValueError(f"the AMX backend takes int8 weights, not {weights}")
        if not _bf16.amx_usable():
            raise RuntimeError(f"dflash2 AMX backend requested but unavailable: {amx.amx_status()}")


def pack_for_backend(weights: str, backend: str, q: torch.Tensor, scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q int8 [N, K], scale) in the layout ``backend`` multiplies by."""
    if backend == AMX:
        return amx.pack_int8_amx(q), scale
    if backend == KERNEL:
        return _PACK[weights](q, scale)
    return q, scale


def _chunked_linear(x: torch.Tensor, q: torch.Tensor, dequantize) -> torch.Tensor:
    """x fp32 [M, K] @ dequantize(rows)^T over ~32 MB chunks of fp32 weight -> fp32 [M, N]."""
    n, k = q.shape
    rows = max(PANEL, (1 << 23) // max(1, k))
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        y[:, n0 : n0 + rows] = F.linear(x, dequantize(n0, n0 + rows))
    return y


def _fallback_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The products with Q, then ``* scale`` and ``+ bias`` as two separate roundings (like the kernel)."""
    y = _chunked_linear(x, q, lambda n0, n1: q[n0:n1].float())
    y.mul_(scale)
    return y if bias is None else y.add_(bias)


def _fallback_int4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The products with float(Q) * scale (rounded once, like the kernel's weight), then ``+ bias``."""
    y = _chunked_linear(x, q, lambda n0, n1: q[n0:n1].float() * scales[n0:n1].repeat_interleave(GROUP, dim=1))
    return y if bias is None else y.add_(bias)


def _pack_int8(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_int8(q), scale


_QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4}
_PACK = {"int8": _pack_int8, "int4": pack_int4}
_FALLBACK = {"int8": _fallback_int8, "int4": _fallback_int4}
