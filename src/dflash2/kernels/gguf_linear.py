"""CPU linear layer over a GGUF file's own quantized blocks (``--weights gguf``): AMX-INT8, AVX512-VNNI and AVX2
kernels + a PyTorch reference.

What the layer computes (the *quantized target*; the same for every row count, both backends, every thread):

1. each row of x (fp32) is quantized per scale group of the weights (:func:`activation_block`: 32 inputs, or the
   256 of a K-quant super-block): ``dx = max|x| / 127`` (fp32 division), ``xq = round_half_even(x / dx)`` (int8;
   0 where the group is 0), ``bsum`` = the sums of xq per 16;
2. per row m, output n and scale group g in order, from y = 0, with the weight's integer form
   (:mod:`dflash2.kernels.gguf_blocks`: ``w = A * s * (u - zero) + C * c``)::

       J = sum_{k in g} s * (u - zero) * xq                  (int32, exact)
       y = y + (A * dx) * float(J)                           (fp32, separate roundings)
       y = y + (C * dx) * float(sum_{b in g} c_b * sum_{k in b} xq)   (formats with an offset: Q4_1, Q4_K)

3. ``y + bias`` (fp32).

This is llama.cpp's scheme (integer dot products on activations quantized to 8 bits, one scale per 32 inputs for
32-blocks and per 256 for K-quants, as its Q8_0 / Q8_K).  The kernels (``gemm_gguf_avx2.cpp``) and
:func:`reference_matmul` evaluate exactly these operations, so they agree bit for bit, and a row's result never
depends on the other rows nor on the CPU: the integer sums are exact, whichever instructions form them.

Backends: ``"amx-int8"`` (the C++ file built with AMX tiles as well: from 4 rows, the integer sums of up
to 16 rows come from tile products; CPUs listing ``amx_tile`` and ``amx_int8``: Sapphire Rapids and later Xeons),
``"avx512-vnni"`` (built with VPDPBUSD, up to 12 rows per unpacked block of two panels from :func:`pair_min_rows`
rows; CPUs listing ``avx512_vnni`` and ``avx512vl``: Intel Cascade Lake and later, AMD Zen 4 / Zen 5), ``"avx2"``
(built for AVX2 + FMA, 4 rows) and ``"torch"`` (:func:`reference_matmul`: portable, slow; float64 integer sums, the
same fp32 steps).  ``DFLASH2_GGUF_KERNEL`` picks one (``amx``, ``vnni``, ``avx2``, ``torch``); unset, the fastest
kernel the CPU runs is used (AMX unless ``DFLASH2_AMX=off``), and a CPU or build that can run none is an error naming
that switch (no silent fallback).  The packed layout, shared by all backends and by the model store's cache, is built
by :mod:`dflash2.kernels.gguf_packing` and described in the C++ file.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dflash2 import platform
from dflash2.kernels import jit
from dflash2.kernels import packed_linear as _bf16
from dflash2.kernels.boundary import check_packed_blocks
from dflash2.kernels.gguf_packing import PANEL, PackedBlocks, pack_blocks, unpack_blocks
from dflash2.kernels.gguf_blocks import (BLOCK, SUPPORTED_TYPES, BlockTensor, dequantize, integer_weights,
                                         random_blocks, take_rows)
from dflash2.kernels.gguf_quantize import quantize_q4_0, quantize_q8_0

__all__ = ["AMX", "ENV", "PAIRS_ENV", "VNNI", "GgufLinear", "PackedBlocks", "activation_block", "build_namespace",
           "gguf_backend", "gguf_kernel_status", "gguf_kernels_available", "kernel_backends", "kernel_ops",
           "pack_blocks", "pair_min_rows", "quantize_rows", "reference_matmul", "reference_rows", "unpack_blocks"]

ENV = "DFLASH2_GGUF_KERNEL"
KERNEL = _bf16.KERNEL  # "avx2"
VNNI = "avx512-vnni"
AMX = "amx-int8"
TORCH = _bf16.TORCH
_SOURCE = Path(__file__).with_name("gemm_gguf_avx2.cpp")
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off"]


@dataclass(frozen=True)
class _Build:
    """One build of the C++ file: its op namespace, compiler flags and the CPU flags it needs."""

    backend: str
    namespace: str
    cflags: tuple[str, ...]
    cpu_flags: tuple[str, ...]


_VNNI_CFLAGS = (*_CFLAGS, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni")
_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")
_BUILDS = {
    KERNEL: _Build(KERNEL, "dflash2_ggufkernels", tuple(_CFLAGS), ()),
    VNNI: _Build(VNNI, "dflash2_ggufkernels_vnni", (*_VNNI_CFLAGS, "-DDFLASH2_GGUF_NS=dflash2_ggufkernels_vnni"),
                 _VNNI_FLAGS),
    AMX: _Build(AMX, "dflash2_ggufkernels_amx",
                (*_VNNI_CFLAGS, "-mamx-tile", "-mamx-int8", "-DDFLASH2_GGUF_NS=dflash2_ggufkernels_amx"),
                (*_VNNI_FLAGS, "amx_tile", "amx_int8")),
}
_locks = {name: threading.Lock() for name in _BUILDS}
_states: dict[str, dict[str, object]] = {name: {} for name in _BUILDS}


# ------------------------------------------------------------------------------------------------ reference


def quantize_rows(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 [M, K] -> (xq int8 [M, K], dx fp32 [M, K/block], bsum int32 [M, K/16]): step 1 of the module
    docstring, one scale per ``block`` inputs (32, or 256 for K-quants)."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block)  # [M, G, block]
    amax = blocks.abs().amax(dim=2)  # [M, G]
    dx = amax / torch.tensor(127.0, dtype=torch.float32)
    safe = torch.where(amax > 0, dx, torch.ones_like(dx))
    q = torch.where(amax[..., None] > 0, torch.round(blocks / safe[..., None]), torch.zeros_like(blocks))
    xq = q.clamp_(-127, 127).to(torch.int8)  # [M, G, block]
    bsum = xq.to(torch.int32).view(m, -1, 16).sum(dim=2, dtype=torch.int32)  # [M, K/16]
    return xq.view(m, k), dx, bsum


def activation_block(t: BlockTensor | PackedBlocks) -> int:
    """Inputs per activation scale for these weights: one scale group (32, or 256 for K-quants)."""
    return BLOCK * t.group


def _group_integers(xq: torch.Tensor, bsum: torch.Tensor, t: BlockTensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(J fp32 [G, M, N], T fp32 [G, M, N] or None): the exact integer sums per scale group, rounded once."""
    n, k = t.shape
    m, groups = xq.shape[0], k // (BLOCK * t.group)
    w = torch.from_numpy(integer_weights(t)).to(torch.float64).view(n, groups, -1)  # [N, G, 32 group]
    j = torch.einsum("mgk,ngk->gmn", xq.to(torch.float64).view(m, groups, -1), w).to(torch.float32)
    if t.offset is None:
        return j, None
    b32 = bsum.view(m, k // BLOCK, 2).sum(dim=2).to(torch.float64)  # [M, B]
    mult = torch.ones(n, k // BLOCK, dtype=torch.float64) if t.offset_mult is None else \
        torch.from_numpy(t.offset_mult.astype(np.float64))  # [N, B]
    tsum = torch.einsum("mgb,ngb->gmn", b32.view(m, groups, -1), mult.view(n, groups, -1)).to(torch.float32)
    return j, tsum


def reference_matmul(xq: torch.Tensor, dx: torch.Tensor, bsum: torch.Tensor, t: BlockTensor) -> torch.Tensor:
    """Step 2 of the module docstring in PyTorch (activations from :func:`quantize_rows` with
    :func:`activation_block`): fp32 [M, N], bit for bit the kernel's."""
    j, tsum = _group_integers(xq, bsum, t)  # [G, M, N]
    a = torch.from_numpy(t.scale)  # [N, G]
    c = None if t.offset is None else torch.from_numpy(t.offset)
    y = torch.zeros(xq.shape[0], t.shape[0], dtype=torch.float32)
    for g in range(j.shape[0]):
        y = y + (a[None, :, g] * dx[:, g, None]) * j[g]
        if c is not None:
            y = y + (c[None, :, g] * dx[:, g, None]) * tsum[g]
    return y


def reference_rows(x: torch.Tensor, t: BlockTensor) -> torch.Tensor:
    """x fp32 [M, K] through ``t`` as the quantized target computes it (PyTorch)."""
    return reference_matmul(*quantize_rows(x, activation_block(t)), t)


# ------------------------------------------------------------------------------------------------ kernel


def _ops(build: _Build) -> tuple[object, object]:
    namespace = getattr(torch.ops, build.namespace)
    return namespace.gguf_matmul.default, namespace.gguf_quantize_rows.default


def kernel_ops(backend: str) -> tuple[object, object]:
    """(gguf_matmul, gguf_quantize_rows) of a kernel backend's build (built and loaded on first use; an error
    naming the reason when it cannot run here)."""
    state = _ensure(backend)
    if not state["available"]:
        raise RuntimeError(f"the gguf {backend} kernel is unavailable: {state['status']}")
    return _ops(_BUILDS[backend])


def _self_check(build: _Build) -> str:
    """The kernel against :func:`reference_matmul` on every block type, 5 and 9 rows, bit for bit."""
    g = torch.Generator().manual_seed(0)
    op, quantize = _ops(build)
    backend = build.backend
    if backend == AMX and not getattr(torch.ops, build.namespace).gguf_tiles():
        return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    for qtype in SUPPORTED_TYPES:
        t = random_blocks(qtype, 20, 512, seed=1)
        x = torch.randn(21, 512, generator=g)  # 21 rows: two row chunks of the AMX build
        x[1, 32:64] = 0  # an all-zero scale group
        for rows in (x[:5], x[:9], x, x.bfloat16()):  # bf16 rows are read as they are: the same as their exact widening
            got = _matmul(op, quantize(rows, activation_block(t)), pack_blocks(t))
            ref = reference_rows(rows.float(), t)
            if not torch.equal(got, ref):
                return (f"gguf {backend} self-check failed for {qtype}, {rows.shape[0]} {rows.dtype} rows "
                        f"(max abs diff {(got - ref).abs().max().item():.3g})")
    return ""


def _cpp_weights(backend: str, parts: list[PackedBlocks], bias: torch.Tensor | None):
    """A backend build's ``GgufWeights`` holding these runs (views of the same tensors) and the fp32 bias."""
    weights = getattr(torch.classes, build_namespace(backend)).GgufWeights()
    for pb in parts:
        weights.add_run(pb.weight, pb.scale, pb.offset, pb.sub_scales, pb.offset_mult, pb.bits, pb.signed, pb.zero,
                        pb.sub, pb.group, pb.out_features)
    if bias is not None:
        weights.set_bias(bias.contiguous())
    return weights


def _linear_op(backend: str):
    return getattr(torch.ops, build_namespace(backend)).gguf_linear.default


def kernel_backends() -> tuple[str, ...]:
    """The backends run by a build of the C++ file (``avx2``, ``avx512-vnni``, ``amx-int8``)."""
    return tuple(_BUILDS)


def build_namespace(backend: str) -> str:
    """The op namespace of a kernel backend's build (its ops and classes: ``torch.ops.<ns>``,
    ``torch.classes.<ns>``)."""
    return _BUILDS[backend].namespace


def _matmul(op, quantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pb: PackedBlocks) -> torch.Tensor:
    return op(*quantized, pb.weight, pb.scale, pb.offset, pb.sub_scales, pb.offset_mult, pb.bits, pb.signed,
              pb.zero, pb.sub, pb.group, pb.out_features)


PAIRS_ENV = "DFLASH2_GGUF_PAIR_ROWS"


def pair_min_rows() -> int:
    """From how many rows the AVX512-VNNI and AMX builds multiply two panels per 512-bit vector: 4, unless
    ``DFLASH2_GGUF_PAIR_ROWS`` says otherwise (:func:`dflash2.platform.gguf_pair_min_rows`, where the measurements
    are). Blocks of 32 without sub-scales (Q4_0, Q4_1, Q5_0, Q8_0) go in pairs at every row count (their own
    micro-kernel, ``plain_pair_rows``: faster than the 256-bit one from one row). Either choice gives the same bits."""
    return platform.gguf_pair_min_rows()


def _load(build: _Build) -> tuple[bool, str, object]:
    missing = jit.missing_cpu_flags(build.cpu_flags)
    if missing:
        return False, missing, None
    ok, status, op = jit.jit_load(f"gguf-{build.backend}", build.namespace, _SOURCE, list(build.cflags),
                                  f"{build.namespace}.gguf_matmul", lambda _op: _self_check(build),
                                  label=f"gguf {build.backend} ")
    if ok:
        getattr(torch.ops, build.namespace).gguf_pair_min_rows(pair_min_rows())
    return ok, status, op


def _ensure(backend: str) -> dict[str, object]:
    state = _states[backend]
    jit.ensure_loaded(state, _locks[backend], lambda: _load(_BUILDS[backend]), f"gguf {backend} kernel", warn=False)
    return state


def gguf_kernels_available(backend: str = KERNEL) -> bool:
    """True when ``backend``'s build (``avx2``, ``avx512-vnni`` or ``amx-int8``) is usable here (built, self-check
    passed)."""
    return bool(_ensure(backend)["available"])


def gguf_kernel_status(backend: str = KERNEL) -> str:
    return str(_ensure(backend)["status"])


def gguf_backend() -> str:
    """The backend ``DFLASH2_GGUF_KERNEL`` names (``amx``, ``vnni``, ``avx2``, ``torch``), or unset the fastest
    kernel this CPU runs (AMX-INT8 unless ``DFLASH2_AMX=off``, else AVX512-VNNI, else AVX2), as
    :func:`dflash2.platform.choose_backend` picks it; a kernel that is named or needed and cannot run here is an
    error."""
    backend = platform.choose_backend("gguf", gguf_kernels_available)
    if backend != TORCH and not gguf_kernels_available(backend):
        raise RuntimeError(f"--weights gguf needs its {backend} kernel, which is unavailable "
                           f"({gguf_kernel_status(backend)}); set {ENV}=torch for the (slow) PyTorch reference")
    return backend


# ------------------------------------------------------------------------------------------------ module


class GgufLinear(_bf16.CpuLinear):
    """Inference-only CPU ``nn.Linear`` over GGUF blocks: one or more runs of rows (fused projections whose parts
    have different block types, e.g. Q4_K q/k and Q6_K v), each a :class:`PackedBlocks`; outputs concatenated,
    then the fp32 bias added.  See the module docstring for the arithmetic."""

    def __init__(self, parts: list[PackedBlocks], bias: torch.Tensor | None, backend: str) -> None:
        super().__init__()
        if backend not in (*_BUILDS, TORCH):
            raise ValueError(f"unknown backend {backend!r} (expected one of {(*_BUILDS, TORCH)})")
        for i, part in enumerate(parts):  # the C++ layer reads these through raw pointers
            check_packed_blocks(part, f"gguf layer run {i} of {len(parts)}")
        widths = {p.weight.shape[1] * BLOCK for p in parts}
        if len(widths) != 1:
            raise ValueError(f"the runs of a GgufLinear must have the same input width, got {sorted(widths)}")
        self.parts = parts
        self.in_features = widths.pop()
        self.out_features = sum(p.out_features for p in parts)
        self.backend = backend
        self.bias_data = bias  # fp32 [N] or None
        self.weights = "gguf"
        self._blocks = [activation_block(p) for p in parts]  # inputs per activation scale, per part
        self._op, self._quantize = kernel_ops(backend) if backend in _BUILDS else (None, None)
        self._weights = None  # the C++ layer (gguf_linear's GgufWeights), made at the first forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``CpuLinear.forward`` in one C++ call on the kernel backends (the same calls in the same order)."""
        if self.backend not in _BUILDS:
            return super().forward(x)
        if self._weights is None:
            self.cpp_weights()
        op, weights = self._weights
        with jit.no_torch_function():
            return op(x, weights)

    def forward_float(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()`` in one pass on the kernel backends (the model's logits: bf16 outputs widened to fp32
        by the kernel as it stores them, instead of a second pass over [rows, vocab])."""
        if self.backend not in _BUILDS:
            return self(x).float()
        if self._weights is None:
            self.cpp_weights()
        op, weights = self._weights
        with jit.no_torch_function():
            return op(x, weights, True)

    def cpp_weights(self):
        """This layer's C++ ``GgufWeights`` (what ``gguf_linear`` and ``gguf_layer`` read), made once; kernel
        backends only."""
        if self.backend not in _BUILDS:
            raise RuntimeError(f"GgufLinear on the {self.backend} backend has no C++ weights")
        if self._weights is None:
            self._weights = (_linear_op(self.backend), _cpp_weights(self.backend, self.parts, self.bias_data))
        return self._weights[1]

    def __getstate__(self) -> dict:  # the C++ object is not picklable; it is rebuilt at the next forward
        return {**super().__getstate__(), "_weights": None}

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    backend: str | None = None, qtype: str = "Q8_0") -> "GgufLinear":
        """A float [N, K] weight quantized to Q8_0 or Q4_0 blocks (``qtype``; :func:`~dflash2.kernels.gguf_blocks.
        quantize_q8_0` / ``quantize_q4_0``) on the kernel ``backend`` (None: :func:`gguf_backend`): for weights no
        GGUF file holds (a merged drafter)."""
        quantizers = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0}
        if qtype not in quantizers:
            raise ValueError(f"GgufLinear.from_weight quantizes to {' or '.join(quantizers)}, not {qtype!r}")
        blocks = quantizers[qtype](weight.detach().to("cpu"))  # (widened to fp32 by chunks, in cache)
        b = None if bias is None else bias.detach().to("cpu", torch.float32).contiguous()
        return cls([pack_blocks(blocks)], b, backend or gguf_backend())

    @classmethod
    def from_linear(cls, linear: torch.nn.Module, backend: str | None = None, qtype: str = "Q8_0") -> "GgufLinear":
        return cls.from_weight(linear.weight, linear.bias, backend, qtype)

    kernel_takes_bf16 = True  # the kernel quantizes bf16 rows as they are (widening to fp32 is exact)

    @property
    def on_amx(self) -> bool:  # the AMX build (tiles from 4 rows; not flat: CpuLinear.flat_on_tiles stays False)
        return self.backend == AMX

    @property
    def row_kernel(self) -> bool:  # every build of the C++ file (avx2, avx512-vnni, amx-int8)
        return self.backend in _BUILDS

    def kernel_rows(self, x: torch.Tensor) -> torch.Tensor:  # fp32 / bf16 [M, K] -> fp32 [M, N]
        quantized: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # scale group -> quantized rows
        ys = []
        for part, block in zip(self.parts, self._blocks):
            if block not in quantized:
                quantized[block] = self._quantize(x, block)
            ys.append(_matmul(self._op, quantized[block], part))
        return self._finish(ys)

    def fallback_rows(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        quantized = {block: quantize_rows(x, block) for block in {activation_block(p) for p in self.parts}}
        return self._finish([_chunked_reference(quantized[activation_block(p)], p) for p in self.parts])

    def _finish(self, ys: list[torch.Tensor]) -> torch.Tensor:
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)
        return y if self.bias_data is None else y.add_(self.bias_data)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K] (what gguf.quants.dequantize gives for these blocks)."""
        return torch.cat([torch.from_numpy(dequantize(unpack_blocks(p))) for p in self.parts])

    def select_rows(self, rows: torch.Tensor) -> "GgufLinear":
        """A layer whose outputs are the outputs ``rows`` [N'] of this one, in that order, on the same blocks (no
        re-quantization: each output row's blocks and scales are its own, so they are copied as they are; used
        for a drafter's head over a draft vocabulary)."""
        rows = rows.to("cpu", torch.int64)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.out_features):
            raise ValueError(f"rows must lie in [0, {self.out_features}); got {int(rows.min())}..{int(rows.max())}")
        ids = rows.numpy()
        starts = np.cumsum([0] + [p.out_features for p in self.parts])
        owner = np.searchsorted(starts, ids, side="right") - 1  # the part of each row
        full = [unpack_blocks(p) for p in self.parts]
        cut = np.flatnonzero(np.diff(owner)) + 1  # consecutive rows of the same part form one run
        runs: list[PackedBlocks] = []
        for run in np.split(np.arange(len(ids)), cut):
            if len(run):  # (no rows: one empty run)
                part = owner[run[0]]
                runs.append(pack_blocks(take_rows(full[part], ids[run] - starts[part])))
        bias = None if self.bias_data is None else self.bias_data[rows].clone()
        return GgufLinear(runs, bias, self.backend)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extra_repr(self) -> str:
        kinds = "+".join(p.qtype for p in self.parts)
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias_data is not None}, blocks={kinds}, backend={self.backend}")


def _chunked_reference(quantized, pb: PackedBlocks) -> torch.Tensor:
    """:func:`reference_matmul` over ~4096-row slices of ``pb`` (bounded float64 temporaries)."""
    step = PANEL * 512
    ys = [reference_matmul(*quantized, unpack_blocks(pb, slice(n0, n0 + step)))
          for n0 in range(0, pb.out_features, step)]
    return torch.cat(ys, dim=1)
