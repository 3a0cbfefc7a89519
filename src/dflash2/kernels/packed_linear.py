"""CPU linear layer over pre-packed bf16 weights, backed by a JIT-built AVX2/FMA kernel (AVX-512 for calls of
4 or more rows where the CPU has it, with bitwise the same results).

Why: torch's CPU ``F.linear`` with bf16 weights is compute-bound on machines without native bf16
(its cost grows linearly with the number of activation rows), so verifying 1 + k speculative
tokens costs ~k times one decode step.  The kernel in ``gemm_avx2.cpp`` reads the bf16 weights
once per call and converts them to fp32 in registers, so 2..16 rows cost about what one does.

The kernel is built on first use with ``torch.utils.cpp_extension.load`` (needs ninja and a C++
compiler) into ``$DFLASH2_HOME/kernels/<torch+python tag>`` (default ``~/.cache/dflash2``), once
per process, and checked against ``F.linear`` on a small case before it is used.  If the CPU
lacks AVX2/FMA, the build fails, or ``DFLASH2_KERNELS=off`` is set, a pure-PyTorch path with the
same semantics is used instead; that choice is made once and announced by one warning.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash2 import platform
from dflash2.kernels import amx, dpbf16
from dflash2.kernels.boundary import check_packed_bf16
from dflash2.kernels.jit import ensure_loaded, jit_load, self_check_mismatch

__all__ = [
    "PackedLinear",
    "default_backend",
    "kernel_status",
    "kernels_available",
    "pack_weight",
    "tile_verification",
    "unpack_weight",
]

PANEL = 16  # output features per packed panel (must match kPanel in gemm_avx2.cpp)
_EXT_NAME = "dflash2_kernels"
_SOURCE = Path(__file__).with_name("gemm_avx2.cpp")
# -fopenmp: at::parallel_for is a header template that expands to `#pragma omp parallel` (torch's
# CPU builds use OpenMP); without the flag it silently runs on one thread (jit.LDFLAGS links it).
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]

# Backend names of a PackedLinear.
KERNEL = "avx2"
AMX = "amx"  # Intel AMX tiles (kernels/amx.py), where the CPU has them
DPBF16 = "avx512bf16"  # VDPBF16PS over the AMX layout (kernels/dpbf16.py), where the CPU has AVX512-BF16
TILE_LAYOUT = (AMX, DPBF16)  # backends on pack_weight_amx's layout, fed bf16 rows
TORCH = "torch"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "available": bool, "status": str, "op": callable


# ----------------------------------------------------------------------------------------------
# Building / loading the kernel (once per process; the helpers are in kernels/jit.py)
# ----------------------------------------------------------------------------------------------


def _self_check(op) -> str:
    """Compare the kernel with F.linear on small shapes that hit every code path."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((3, 24, 40), (1, 7, 19), (30, 33, 300)):
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g)
        b = torch.randn(n, generator=g)
        bad = self_check_mismatch(op(x, pack_weight(w), b, n), F.linear(x, w.float(), b), k, "")
        if bad:
            return bad
    return ""


def _load() -> tuple[bool, str, object]:
    ok, status, op = jit_load("bf16", _EXT_NAME, _SOURCE, _CFLAGS, "dflash2_kernels.packed_linear", _self_check,
                              label="AVX2/FMA ")
    if ok and "avx512f" in platform.cpu().flags:
        status += " (AVX-512 micro-kernel for 4+ rows)"
    return ok, status, op


def _ensure_loaded() -> None:
    ensure_loaded(_state, _lock, _load, "packed CPU linear kernel")


def kernels_available() -> bool:
    """True when the AVX2/FMA kernel is built, loaded and passed its self-check.  The first call
    builds it (tens of seconds the first time on a machine, then cached on disk)."""
    _ensure_loaded()
    return bool(_state["available"])


def kernel_status() -> str:
    """One line: where the kernel was loaded from, or why it is not available."""
    _ensure_loaded()
    return str(_state["status"])


# ----------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float weight -> bf16 [ceil(N/16), K, 16] panels (rows past N are zero).

    Within panel p and column k, element 2*i + h holds W[16p + 8h + i, k] (i < 8, h < 2): the
    32-bit word i carries output i in its low half and output 8 + i in its high half.  Converted
    to bf16 with round-to-nearest-even, exactly like ``weight.to(torch.bfloat16)``.  Works in
    chunks of panels so the only full-size allocation is the result.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    w = weight.detach()
    if w.device.type != "cpu":
        w = w.cpu()
    n, k = w.shape
    p = -(-n // PANEL)
    out = torch.empty(p, k, PANEL, dtype=torch.bfloat16)
    full = n // PANEL
    step = max(1, (1 << 24) // max(1, k * PANEL * 4))  # ~16 MB of source per chunk
    for p0 in range(0, full, step):
        p1 = min(full, p0 + step)
        src = w[p0 * PANEL : p1 * PANEL].reshape(p1 - p0, 2, 8, k).permute(0, 3, 2, 1)
        out[p0:p1].view(p1 - p0, k, 8, 2).copy_(src)
    if full < p:
        tail = torch.zeros(PANEL, k, dtype=torch.bfloat16)
        tail[: n - full * PANEL].copy_(w[full * PANEL :])
        out[full].view(k, 8, 2).copy_(tail.view(2, 8, k).permute(2, 1, 0))
    return out


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: bf16 [P, K, 16] -> bf16 [N, K] (exact)."""
    p, k, _ = packed.shape
    return packed.view(p, k, 8, 2).permute(0, 3, 2, 1).reshape(p * PANEL, k)[:out_features].clone()


# ----------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------


class CpuLinear(nn.Module):
    """What the CPU replacements of ``nn.Linear`` share: input checks, fp32 rows, row blocks for the kernel,
    output in the input's dtype. Subclasses hold ``in_features``, ``out_features``, ``backend``, ``bias_data``
    and implement :meth:`kernel_rows` (the kernel on fp32 [M, K] rows) and :meth:`fallback_rows` (PyTorch)."""

    in_features: int
    out_features: int
    backend: str
    bias_data: torch.Tensor | None
    kernel_takes_bf16 = False  # kernel_rows reads bf16 rows as they are (no fp32 copy first)
    # On backend "amx": the whole K sum in tiles, so 1-16 rows cost about one (bf16, int8); the gguf build's
    # per-block fp32 steps grow with the rows, so it leaves this False.
    flat_on_tiles = False

    @property
    def on_amx(self) -> bool:
        """This layer's kernel runs on AMX tiles (flat or not: the gguf build counts, :func:`amx_verification`)."""
        return self.backend == AMX

    @property
    def row_kernel(self) -> bool:
        """True when :meth:`kernel_rows` (a JIT kernel over fp32 / bf16 rows) computes this layer's outputs."""
        return self.backend == KERNEL

    @property
    def bias(self) -> torch.Tensor | None:
        return self.bias_data

    def kernel_rows(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """fp32 or bf16 (kernel_takes_bf16) [M, K] -> fp32 [M, N]; on the tile layout with bf16 rows and
        ``bf16_out``, bf16 [M, N] rounded by the kernel as it stores them."""
        raise NotImplementedError

    def fallback_rows(self, x: torch.Tensor) -> torch.Tensor:  # fp32 [M, K] -> fp32 [M, N]
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        if x.device.type != "cpu":
            raise RuntimeError(f"{name} runs on CPU only (got input on {x.device})")
        k = self.in_features
        if x.shape[-1] != k:
            raise ValueError(f"{name}: expected last dim {k}, got shape {tuple(x.shape)}")
        lead = x.shape[:-1]
        if self.backend in TILE_LAYOUT:  # bf16 rows as they are (amx.py: fp32 rows as two bf16 parts)
            rows = x.reshape(-1, k).contiguous()
            if rows.dtype == torch.bfloat16:  # bf16 outputs stored by the kernel: no fp32 [M, N] pass
                y = _row_chunked(lambda r: self.kernel_rows(r, bf16_out=True), rows, self.out_features, rows.dtype)
                return y.view(*lead, self.out_features)
            y = _row_chunked(self.kernel_rows, rows, self.out_features)
        elif self.row_kernel:
            x2 = x.reshape(-1, k)  # [M, K] fp32 (a copy unless already fp32, or bf16 that the kernel reads)
            x2 = x2.contiguous() if self.kernel_takes_bf16 and x2.dtype == torch.bfloat16 else x2.float().contiguous()
            y = _row_chunked(self.kernel_rows, x2, self.out_features)
        else:
            y = self.fallback_rows(x.reshape(-1, k).float())
        y = y.view(*lead, self.out_features)  # [..., N]
        return y if x.dtype == torch.float32 else y.to(x.dtype)


class PackedLinear(CpuLinear):
    """Inference-only CPU replacement for ``nn.Linear`` with bf16 weights.

    ``y = x @ W^T + b`` computed as ``F.linear(x.float(), W_bf16.float(), b_fp32)`` (fp32
    accumulation), returned in ``x``'s dtype.  The weight is rounded to bf16 and packed once by
    :meth:`from_linear`; afterwards only the packed tensor is held (no fp32 or [N, K] copy), as a
    plain attribute rather than a parameter or buffer, so ``.to()``/``.half()`` leave it alone
    and ``state_dict()`` does not include it -- export with :meth:`unpacked_weight`.

    CPU tensors only: on CUDA keep the ``nn.Linear`` (the caller decides; ``forward`` raises on
    a non-CPU input).  No autograd.

    Backends: ``"amx"`` (Intel AMX tiles, :mod:`dflash2.kernels.amx`), ``"avx512bf16"`` (VDPBF16PS on the same
    layout, :mod:`dflash2.kernels.dpbf16`), ``"avx2"`` (the packed kernel) or
    ``"torch"`` (fallback: the bf16 [N, K] weight and ``F.linear`` on fp32 chunks).
    ``from_linear(..., backend=None)`` picks the first available (:func:`default_backend`).
    """

    flat_on_tiles = True

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
        backend: str,
    ) -> None:
        super().__init__()
        if backend not in (AMX, DPBF16, KERNEL, TORCH):
            raise ValueError(f"unknown backend {backend!r} (expected {AMX!r}, {DPBF16!r}, {KERNEL!r} or {TORCH!r})")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.backend = backend
        # Plain attributes on purpose (see class docstring).
        self.weight_data = weight  # amx, avx512bf16: [P, S, 16, 32]; avx2: packed [P, K, 16]; torch: [N, K]; all bf16
        self.bias_data = bias  # fp32 [N] or None
        _check_backend(backend)
        if backend != TORCH:  # the C++ kernels read these panels through raw pointers
            check_packed_bf16(backend in TILE_LAYOUT, weight, bias, self.in_features, self.out_features)
        self._op = _state["op"] if backend == KERNEL else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, backend: str | None = None) -> "PackedLinear":
        """Pack ``linear`` (weight of any float dtype -> bf16; bias kept as fp32)."""
        return cls.from_weight(linear.weight, linear.bias, backend=backend)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None
    ) -> "PackedLinear":
        """Same as :meth:`from_linear` from a raw [N, K] weight and optional [N] bias."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out_features, in_features], got {tuple(weight.shape)}")
        if backend is None:
            backend = default_backend()
        _check_backend(backend)
        n, k = weight.shape
        with torch.no_grad():
            if backend in TILE_LAYOUT:
                w = amx.pack_weight_amx(weight)
            elif backend == KERNEL:
                w = pack_weight(weight)
            else:
                w = weight.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
            b = None
            if bias is not None:
                b = bias.detach().to(device="cpu", dtype=torch.float32).contiguous()
                if b.shape != (n,):
                    raise ValueError(f"bias shape {tuple(b.shape)} != ({n},)")
        return cls(w, b, k, n, backend)

    def unpacked_weight(self) -> torch.Tensor:
        """The bf16 [out_features, in_features] weight (a new tensor)."""
        if self.backend in TILE_LAYOUT:
            return amx.unpack_weight_amx(self.weight_data, self.out_features, self.in_features)
        if self.backend == KERNEL:
            return unpack_weight(self.weight_data, self.out_features)
        return self.weight_data.clone()

    def kernel_rows(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        if self.backend == AMX:
            return amx.amx_linear_rows(x, self.weight_data, self.bias_data, self.out_features, bf16_out)
        if self.backend == DPBF16:
            return dpbf16.dpbf16_linear_rows(x, self.weight_data, self.bias_data, self.out_features, bf16_out)
        return self._op(x, self.weight_data, self.bias_data, self.out_features)

    def fallback_rows(self, x: torch.Tensor) -> torch.Tensor:
        return _fallback_linear(x, self.weight_data, self.bias_data)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias_data is not None}, backend={self.backend}"
        )


def _kernel_linear(model: nn.Module) -> CpuLinear | None:
    """The first layer's gate / up projection of ``model`` (a Transformer), standing for its linear layers, when it
    is one of the CPU kernels' layers."""
    layers = getattr(model, "layers", None)
    gate_up = layers[0].ffn.w_gate_up if layers else None
    return gate_up if isinstance(gate_up, CpuLinear) else None


def tile_verification(model: nn.Module) -> bool:
    """Whether ``model``'s (a Transformer's) linear layers run on AMX tiles over the whole K (bf16, or int8 widened
    to bf16: ``CpuLinear.flat_on_tiles``), where a forward of 1-16 rows costs about the same (kernels/gemm_amx.cpp):
    verifying a tree of drafts costs about what a chain does."""
    linear = _kernel_linear(model)
    return linear is not None and linear.flat_on_tiles and linear.on_amx


def amx_verification(model: nn.Module) -> bool:
    """Whether ``model``'s linear layers verify on AMX tiles in any form: flat (:func:`tile_verification`) or the
    GGUF kernel's AMX build (from 4 rows; its fp32 steps per block grow with the rows, a forward of 9 rows costs
    1.3-1.6x one on an Emerald Rapids Xeon). The batch server's ``auto`` drafts with pard there (drafters/spec.py)."""
    linear = _kernel_linear(model)
    return linear is not None and linear.on_amx


def dpbf16_usable() -> bool:
    """The AVX512-BF16 backend may be used: the packed kernels are enabled here and that kernel loaded."""
    return kernels_available() and dpbf16.dpbf16_available()


def amx_usable() -> bool:
    """The AMX backend may be used: the packed kernels are enabled here and the AMX kernel loaded."""
    return kernels_available() and amx.amx_available()


def default_backend() -> str:
    """The fastest backend available here (:func:`dflash2.platform.choose_backend`): ``amx`` where the CPU has
    AMX-BF16, else ``avx512bf16`` where it has AVX512-BF16, else ``avx2``, else ``torch``."""
    usable = {AMX: amx_usable, DPBF16: dpbf16_usable, KERNEL: kernels_available}
    return platform.choose_backend("bf16", lambda backend: usable[backend]())


def _check_backend(backend: str) -> None:
    if backend == KERNEL and not kernels_available():
        raise RuntimeError(f"dflash2 kernel backend requested but unavailable: {kernel_status()}")
    if backend == AMX and not amx_usable():
        raise RuntimeError(f"dflash2 AMX backend requested but unavailable: {amx.amx_status()}")
    if backend == DPBF16 and not dpbf16_usable():
        raise RuntimeError(f"dflash2 AVX512-BF16 backend requested but unavailable: {dpbf16.dpbf16_status()}")


# The kernel streams all rows of x past each 16-output weight panel, so x is re-read once per panel; past a few
# hundred rows (prefill) x leaves the cache and the GEMM turns memory-bound. Row blocks of this size keep x in L2.
# The kernel is row-count invariant (bitwise), so cutting the rows does not change any result.
ROW_BLOCK = 256


def _row_chunked(op, x: torch.Tensor, out_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``op`` over row blocks of ``x`` [M, K] -> [M, out_features] of ``dtype`` (what ``op`` returns)."""
    m = x.shape[0]
    if m <= ROW_BLOCK:
        return op(x)
    y = torch.empty(m, out_features, dtype=dtype)
    for r0 in range(0, m, ROW_BLOCK):
        y[r0 : r0 + ROW_BLOCK] = op(x[r0 : r0 + ROW_BLOCK])
    return y


def _fallback_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``F.linear`` over bf16 weight rows, converted in ~32 MB chunks."""
    n, k = w.shape
    rows = max(PANEL, (1 << 25) // max(1, 4 * k))
    if rows >= n:
        return F.linear(x, w.float(), bias)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        b = None if bias is None else bias[n0:n1]
        y[:, n0:n1] = F.linear(x, w[n0:n1].float(), b)
    return y
