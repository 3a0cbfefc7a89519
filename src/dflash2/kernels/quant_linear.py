"""CPU linear layer over int8 weight-only quantized weights, backed by a JIT-built AVX2/FMA kernel.

Format ``int8``: symmetric per-output-channel quantization, ``W[n, :] ~= scale[n] * Q[n, :]`` with
``Q`` int8 in [-127, 127] and ``scale[n] = max|W[n, :]| / 127`` (fp32).  The layer computes
``y = (x @ Q^T) * scale + bias`` in fp32: the kernel in ``gemm_q8_avx2.cpp`` reads the int8 panels
once per call (half the bytes of bf16), converts them to fp32 in registers and applies the scale
after the sum.  Every output is one in-order fp32 FMA chain over k, so the result for a row does
not depend on how many rows are in the call (speculative verification stays exactly lossless with
respect to the quantized model).

The kernel is built like the bf16 one (:mod:`dflash2.kernels.packed_linear`: ninja + a C++
compiler, ``DFLASH2_KERNELS=off`` forces the fallback) but under its own extension name and a build
directory named after a hash of its source, so differently edited copies never share a build.  The
fallback (``F.linear`` over the int8 weight converted to fp32 in chunks, then the same scale and
bias) gives the same numbers up to the order of the fp32 sum; it is announced by one warning.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.kernels import packed_linear as _bf16

__all__ = ["QuantLinear", "quant_kernel_status", "quant_kernels_available", "quantize_int8", "pack_int8"]

PANEL = 16  # output features per packed panel (kPanel in gemm_q8_avx2.cpp)
_SOURCE = Path(__file__).with_name("gemm_q8_avx2.cpp")
# -ffp-contract=off: the scale and the bias are two roundings, as in the fallback (no fused FMA).
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]

KERNEL = "avx2"
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


# ----------------------------------------------------------------------------------------------
# Building / loading the kernel (once per process)
# ----------------------------------------------------------------------------------------------


def _source_tag() -> str:
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(_CFLAGS).encode()).hexdigest()[:12]


def _self_check(op) -> str:
    """Compare the kernel with the fallback on small shapes that hit every code path."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((3, 24, 40), (1, 7, 19), (13, 70, 300)):
        q, s = quantize_int8(torch.randn(n, k, generator=g))
        x = torch.randn(m, k, generator=g)
        b = torch.randn(n, generator=g)
        got = op(x, pack_int8(q), s, b, n)
        ref = _fallback_int8(x, q, s, b)
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * (k**0.5)):
            return f"self-check failed for M={m} N={n} K={k} (max abs err {(got - ref).abs().max().item():.3g})"
    return ""


def _load() -> tuple[bool, str, object]:
    tag = _source_tag()
    return _bf16.jit_load(f"dflash2_qkernels_{tag}", _SOURCE, _CFLAGS, _bf16._build_dir() / f"q8-{tag}",
                          "dflash2_qkernels.int8_linear", _self_check, label="int8 ")


def _ensure_loaded() -> None:
    _bf16.ensure_loaded(_state, _lock, _load, "int8 CPU linear kernel")


def quant_kernels_available() -> bool:
    """True when the int8 kernel is built, loaded and passed its self-check (builds it on first call)."""
    _ensure_loaded()
    return bool(_state["available"])


def quant_kernel_status() -> str:
    """One line: where the int8 kernel was loaded from, or why it is not available."""
    _ensure_loaded()
    return str(_state["status"])


# ----------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------


class QuantLinear(nn.Module):
    """Inference-only CPU replacement for ``nn.Linear`` with int8 weight-only quantized weights.

    ``y = F.linear(x.float(), Q.float()) * scale + bias`` in fp32, returned in ``x``'s dtype.  Like
    :class:`~dflash2.kernels.PackedLinear`, the weights are plain attributes (``.to()`` and
    ``state_dict()`` leave them alone); export with :meth:`dequantized_weight`.

    Backends: ``"avx2"`` (packed int8 panels, the kernel) or ``"torch"`` (int8 [N, K] and
    ``F.linear`` on fp32 chunks).  ``backend=None`` picks ``"avx2"`` when the kernel is available.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 in_features: int, out_features: int, backend: str) -> None:
        super().__init__()
        if backend not in (KERNEL, TORCH):
            raise ValueError(f"unknown backend {backend!r} (expected {KERNEL!r} or {TORCH!r})")
        if backend == KERNEL and not quant_kernels_available():
            raise RuntimeError(f"dflash2 int8 kernel backend requested but unavailable: {quant_kernel_status()}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.backend = backend
        self.weight_data = q  # avx2: packed int8 [P, K, 16]; torch: int8 [N, K]
        self.scale_data = scale  # fp32 [N]
        self.bias_data = bias  # fp32 [N] or None
        self._op = _state["op"] if backend == KERNEL else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str | None = None) -> "QuantLinear":
        return cls.from_weight(linear.weight, linear.bias, backend=backend)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    backend: str | None = None) -> "QuantLinear":
        """Quantize a raw [N, K] weight (any float dtype) and keep an optional [N] bias in fp32."""
        if backend is None:
            backend = KERNEL if quant_kernels_available() else TORCH
        n, k = weight.shape
        q, scale = quantize_int8(weight)
        b = None
        if bias is not None:
            b = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
            if b.shape != (n,):
                raise ValueError(f"bias shape {tuple(b.shape)} != ({n},)")
        return cls(pack_int8(q) if backend == KERNEL else q, scale, b, k, n, backend)

    def int8_weight(self) -> torch.Tensor:
        """Q int8 [out_features, in_features] (a new tensor)."""
        if self.backend == KERNEL:
            return unpack_int8(self.weight_data, self.out_features)
        return self.weight_data.clone()

    def dequantized_weight(self) -> torch.Tensor:
        """``scale[:, None] * Q`` in fp32 [out_features, in_features]."""
        return self.int8_weight().float() * self.scale_data[:, None]

    @property
    def bias(self) -> torch.Tensor | None:
        return self.bias_data

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(f"QuantLinear runs on CPU only (got input on {x.device})")
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"QuantLinear: expected last dim {k}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
        if self.backend == KERNEL:
            y = self._op(x2, self.weight_data, self.scale_data, self.bias_data, self.out_features)
        else:
            y = _fallback_int8(x2, self.weight_data, self.scale_data, self.bias_data)
        y = y.view(*lead, self.out_features)  # [..., N]
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_data is not None}, weights=int8, backend={self.backend}")


def _fallback_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x fp32 [M, K], q int8 [N, K] -> fp32 [M, N]: the products in ~32 MB chunks of fp32 weight, then
    ``* scale`` and ``+ bias`` as two separate roundings (like the kernel)."""
    n, k = q.shape
    rows = max(PANEL, (1 << 23) // max(1, k))
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        y[:, n0 : n0 + rows] = F.linear(x, q[n0 : n0 + rows].float())
    y.mul_(scale)
    if bias is not None:
        y.add_(bias)
    return y
