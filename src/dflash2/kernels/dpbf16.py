"""The AVX512-BF16 path of :class:`~dflash2.kernels.PackedLinear`: VDPBF16PS over the AMX weight layout
(``gemm_dpbf16.cpp``).

For CPUs with AVX512-BF16 and no AMX (AMD Zen 4 / Zen 5, Intel Cooper Lake): one instruction multiplies 16 pairs
of bf16 weights by a pair of x and adds both products to 16 fp32 lanes, so a call of up to about 8 rows costs about
the bytes it reads (the AVX2 kernel's cost grows by half from 1 to 7 rows).  Chosen at run time, after AMX: the CPU
must list ``avx512_bf16``, the kernel must build and pass its self-check, and ``DFLASH2_DPBF16`` must not be
``off`` (nor ``DFLASH2_KERNELS``).

Arithmetic and layout are the AMX path's (:mod:`dflash2.kernels.amx`): the packed weights are the same tensor, a
bf16 x is multiplied as it is and an fp32 x as hi + lo bf16 parts; every output is one chain of VDPBF16PS over k in
order whatever the number of rows, so the kernel is row-count invariant (tested) and speculation stays lossless.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dflash2 import platform
from dflash2.kernels import amx as _amx
from dflash2.kernels import jit

__all__ = ["dpbf16_available", "dpbf16_linear_rows", "dpbf16_status"]

_SOURCE = Path(__file__).with_name("gemm_dpbf16.cpp")
_CFLAGS = ["-O3", "-mavx512f", "-mavx512bf16", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _disabled_reason() -> str:
    return platform.settings().dpbf16.reason or jit.missing_cpu_flags(("avx512f", "avx512_bf16"))


def _self_check(op) -> str:
    return _amx.tile_self_check(op, ((3, 24, 40), (1, 7, 19), (13, 70, 3000)), "AVX512-BF16 ")  # 3000: 2 k chunks


def _load() -> tuple[bool, str, object]:
    reason = _disabled_reason()
    if reason:
        return False, reason, None
    return jit.jit_load("dpbf16", "dflash2_dpbf16", _SOURCE, _CFLAGS, "dflash2_dpbf16.dpbf16_linear", _self_check,
                        label="AVX512-BF16 ")


def _ensure_loaded() -> None:
    # No warning when it is not available: PackedLinear then uses the AVX2 kernel, as on most CPUs.
    jit.ensure_loaded(_state, _lock, _load, "AVX512-BF16 kernel", warn=False)


def dpbf16_available() -> bool:
    """True when the AVX512-BF16 kernel is usable here (built, self-check passed)."""
    _ensure_loaded()
    return bool(_state["available"])


def dpbf16_status() -> str:
    """One line: where the AVX512-BF16 kernel was loaded from, or why it is not used."""
    _ensure_loaded()
    return str(_state["status"])


def dpbf16_linear_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                       bf16_out: bool = False) -> torch.Tensor:
    """x [M, K] (bf16 as it is; fp32 as hi + lo bf16 parts) -> fp32 [M, n]; ``packed`` from ``pack_weight_amx``;
    ``bf16_out`` as in :func:`dflash2.kernels.amx.tile_linear_rows`."""
    return _amx.tile_linear_rows(_state["op"], x, packed, bias, n, bf16_out)
