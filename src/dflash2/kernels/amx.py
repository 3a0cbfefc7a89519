"""The Intel AMX path of :class:`~dflash2.kernels.PackedLinear`: bf16 tiles, fp32 accumulation (``gemm_amx.cpp``).

Where the CPU has AMX-BF16 (Sapphire Rapids and later Xeons) one tile instruction multiplies 16 rows of x by a
1 KiB tile of weights, so a linear layer costs about the bytes it reads for any number of rows up to 16: verifying
a block of drafts costs what one decoding step costs.  Chosen at run time: the CPU must list ``amx_tile`` and
``amx_bf16``, Linux must grant the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), the kernel must build and pass
its self-check, and ``DFLASH2_AMX`` must not be ``off`` (nor ``DFLASH2_KERNELS``).  Otherwise PackedLinear uses
the AVX2 kernel as before.

Arithmetic: x is multiplied in bf16.  A bf16 x (a bf16 model's activations) is used as it is; an fp32 x is split
into ``hi = bf16(x)`` and ``lo = bf16(x - hi)`` and both are multiplied (about 16 bits of x, relative error ~1e-5),
so fp32 callers keep nearly fp32 accuracy.  Every output is the same chain of tile updates over k whatever the
number of rows (row-count invariant, tested), so speculation stays lossless in bf16 on this path too; results
differ in rounding from the AVX2 kernel's (another machine, another rounding), never within one machine.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash2 import platform
from dflash2.kernels import jit

__all__ = ["amx_available", "amx_int8_rows", "amx_linear_rows", "amx_status", "pack_int8_amx",
           "pack_weight_amx", "tile_linear_rows", "tile_self_check", "unpack_int8_amx", "unpack_weight_amx"]

PANEL = 16  # outputs per panel (kPanel in gemm_amx.cpp)
STEP = 32  # k per tile step (kStep)
_SOURCE = Path(__file__).with_name("gemm_amx.cpp")
# -ffp-contract=off: int8 applies the scale and the bias as two roundings (no fused FMA), like the AVX2 int8 kernel.
_CFLAGS = ["-O3", "-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw", "-mavx512vbmi", "-fopenmp", "-ffp-contract=off"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _disabled_reason() -> str:
    return platform.settings().amx.reason or jit.missing_cpu_flags(("amx_tile", "amx_bf16", "avx512_bf16",
                                                                      "avx512vbmi"))


def tile_self_check(op, shapes: tuple[tuple[int, int, int], ...], label: str) -> str:
    """Compare a kernel on the tile layout (``op(x, packed, bias, m, n)``, bf16 x) with F.linear on (m, n, k) shapes;
    "" when it matches, else one line."""
    g = torch.Generator().manual_seed(0)
    for m, n, k in shapes:
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        b = torch.randn(n, generator=g)
        bad = jit.self_check_mismatch(_call(op, x, pack_weight_amx(w), b, n), F.linear(x.float(), w.float(), b),
                                      k, label)
        if bad:
            return bad
    return ""


def _self_check(op) -> str:
    if not torch.ops.dflash2_amx.amx_init():
        return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return tile_self_check(op, ((3, 24, 40), (1, 7, 19), (30, 70, 300)), "AMX ")


def _load() -> tuple[bool, str, object]:
    reason = _disabled_reason()
    if reason:
        return False, reason, None
    return jit.jit_load("amx", "dflash2_amx", _SOURCE, _CFLAGS, "dflash2_amx.amx_linear", _self_check, label="AMX ")


def _ensure_loaded() -> None:
    # No warning when it is not available: most CPUs have no AMX, and PackedLinear then uses the AVX2 kernel.
    jit.ensure_loaded(_state, _lock, _load, "AMX kernel", warn=False)


def amx_available() -> bool:
    """True when the AMX kernel is usable here (built, tile state granted, self-check passed).  Not available is
    normal on most CPUs and says nothing: PackedLinear then uses the AVX2 kernel."""
    _ensure_loaded()
    return bool(_state["available"])


def amx_status() -> str:
    """One line: where the AMX kernel was loaded from, or why it is not used."""
    _ensure_loaded()
    return str(_state["status"])


def pack_weight_amx(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float weight -> bf16 [P, S, 16, 32] (P = ceil(N/16), S = ceil(K/32), zero padded), element
    [p, s, r, 2c + h] = W[16p + c, 32s + 2r + h]: the pair rows of TDPBF16PS's B operand."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    return _to_tiles(weight.detach().cpu(), torch.bfloat16)


def pack_int8_amx(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int8 [P, S, 16, 32]: the layout of :func:`pack_weight_amx`, each 64-byte chunk stored in the
    order the kernel's widening puts back (:func:`_int8_chunk_order`)."""
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(f"expected an int8 [N, K] tensor, got {q.dtype} {tuple(q.shape)}")
    tiles = _to_tiles(q, torch.int8)
    return _int8_chunk_order(tiles.view(-1, 2, 4, 8)).reshape(tiles.shape)


def unpack_int8_amx(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_int8_amx`: int8 [P, S, 16, 32] -> int8 [N, K] (exact)."""
    natural = _int8_chunk_order(packed.reshape(-1, 4, 2, 8)).reshape(packed.shape)
    return unpack_weight_amx(natural, out_features, in_features)


def _int8_chunk_order(chunks: torch.Tensor) -> torch.Tensor:
    """Swap the two middle axes of 64-byte chunks: [C, 2, 4, 8] (h, L, j) -> [C, 4, 2, 8] packs, [C, 4, 2, 8] -> [C, 2,
    4, 8] unpacks.  Stored byte 16L + 8h + j of a chunk holds element 32h + 8L + j, since the kernel's byte
    interleave (VPUNPCK{L,H}BW) works within 128-bit lanes."""
    return chunks.permute(0, 2, 1, 3).contiguous()


def _to_tiles(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] -> dtype [P, S, 16, 32] (see pack_weight_amx), a chunk of panels at a time. The two halves of a pair
    row stay together, so the permutation moves them as one 4-byte (bf16) or 2-byte (int8) element: a third of the
    time of moving each half (the 1.5B's bf16 head: 0.39 -> 0.14 s)."""
    n, k = w.shape
    p, s = -(-n // PANEL), -(-k // STEP)
    out = torch.empty(p, s, STEP // 2, PANEL, 2, dtype=dtype)  # [P, S, pair row, output, half]
    pair = {2: torch.int32, 1: torch.int16}[out.element_size()]
    pairs = out.view(pair).view(p, s, STEP // 2, PANEL)  # [P, S, pair row, output]: one pair per element
    step = max(1, (1 << 24) // max(1, s * STEP * PANEL * 4))  # panels per chunk: ~16 MB of fp32 source
    for p0 in range(0, p, step):
        p1 = min(p, p0 + step)
        rows = w[p0 * PANEL : p1 * PANEL]
        if rows.shape[0] == (p1 - p0) * PANEL and k == s * STEP and rows.dtype == dtype:
            src = rows.contiguous()
        else:  # zero padded to whole panels and steps, in dtype
            src = torch.zeros((p1 - p0) * PANEL, s * STEP, dtype=dtype)
            src[: rows.shape[0], :k] = rows
        # [panels, 16 outputs, S, 16 pair rows] -> [panels, S, pair row, output]
        pairs[p0:p1] = src.view(pair).view(p1 - p0, PANEL, s, STEP // 2).permute(0, 2, 3, 1)
    return out.view(p, s, PANEL, STEP)


def unpack_weight_amx(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight_amx`: bf16 [P, S, 16, 32] -> bf16 [N, K] (exact)."""
    p, s, _, _ = packed.shape
    w = packed.view(p, s, STEP // 2, PANEL, 2).permute(0, 3, 1, 2, 4).reshape(p * PANEL, s * STEP)
    return w[:out_features, :in_features].clone()


def _pad_columns(x: torch.Tensor, kp: int) -> torch.Tensor:
    """bf16 x [M, K] padded with zero columns to kp (the weight's k steps); the kernels take any number of rows (a
    last block of fewer than 16 rows gets a tile configuration of its own: no padded copy of the activations)."""
    k = x.shape[1]
    return (F.pad(x, (0, kp - k)) if kp != k else x).contiguous()


def _call(op, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
          bf16_out: bool = False) -> torch.Tensor:
    return op(_pad_columns(x, packed.shape[1] * STEP), packed, bias, x.shape[0], n, bf16_out)


def _split_fp32(x: torch.Tensor, matmul) -> torch.Tensor:
    """``matmul`` (bf16 [M', K] -> fp32 [M', N], no bias) of an fp32 x as hi + lo bf16 parts, in one call."""
    x = x.float()
    hi = x.to(torch.bfloat16)
    lo = (x - hi.float()).to(torch.bfloat16)
    both = matmul(torch.cat([hi, lo]))  # [2M, N]: one pass over the weights
    m = x.shape[0]
    return both[:m] + both[m:]


def amx_linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                    bf16_out: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 as it is; fp32 as hi + lo bf16 parts) -> fp32 [M, n] on the AMX kernel (see
    :func:`tile_linear_rows` for ``bf16_out``)."""
    return tile_linear_rows(_state["op"], x, packed, bias, n, bf16_out)


def tile_linear_rows(op, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                     bf16_out: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 as it is; fp32 as hi + lo bf16 parts) -> fp32 [M, n] by a kernel on the tile layout; with
    ``bf16_out`` and bf16 x, bf16 [M, n] rounded by the kernel as it stores them (the fp32 result's ``.to(bf16)``)."""
    if x.dtype == torch.bfloat16:
        return _call(op, x, packed, bias, n, bf16_out)
    y = _split_fp32(x, lambda rows: _call(op, rows, packed, None, n))
    return y if bias is None else y + bias


def amx_int8_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  n: int, bf16_out: bool = False) -> torch.Tensor:
    """``(x @ Q^T) * scale + bias`` -> fp32 [M, n] for int8 tiles ``q`` (:func:`pack_int8_amx`); ``bf16_out`` as in
    :func:`tile_linear_rows`."""
    op = torch.ops.dflash2_amx.amx_int8_linear.default
    kp = q.shape[1] * STEP
    if x.dtype == torch.bfloat16:
        return op(_pad_columns(x, kp), q, scale, bias, x.shape[0], n, bf16_out)
    y = _split_fp32(x, lambda rows: op(_pad_columns(rows, kp), q, torch.ones_like(scale), None, rows.shape[0], n))
    y.mul_(scale)
    return y if bias is None else y.add_(bias)
