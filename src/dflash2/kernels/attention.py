"""Row-invariant CPU attention (``attention.cpp``): a query row's output is bitwise the same whatever else is in the
call -- the number of query rows, the mask (causal, tree, padding), the batch companions, the cache layout.

Why: greedy speculative decoding is lossless only if verifying a block of k + 1 rows rounds exactly like decoding
them one at a time.  The linear kernels already are row-count invariant; PyTorch's CPU attention is not (its
reduction order over keys depends on the block of queries and keys it tiles), so in bf16 a near-tie flips and
speculative output drifts from plain output.  This kernel compacts each row's visible keys into a list and runs
every reduction over that list in one fixed order with fp32 accumulation (details in ``attention.cpp``), so the
output depends only on the query and its ordered visible keys/values.  Where the CPU has AVX512-BF16, bf16 q / k / v
take VDPBF16PS dot products (two bf16 products per fp32 lane and instruction; the softmax weights rounded to bf16 for
the values): 1.4-1.8x faster per layer on the AMD EPYC Zen 4, its own fixed order, so other bits than the fp32
chains of CPUs without it (as the bf16 linear layers' VDPBF16PS kernel).

Built on first use like the other kernels (:mod:`dflash2.kernels.jit`: ninja and a C++ compiler, AVX2 + FMA, cached
under ``$DFLASH2_HOME/kernels``), self-checked against ``F.scaled_dot_product_attention``, off with
``DFLASH2_KERNELS=off``.  :func:`dflash2.models.attention.attend` uses it on CPU unless ``DFLASH2_ATTENTION=torch``.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash2 import platform
from dflash2.kernels import jit
from dflash2.kernels.boundary import check_attention

__all__ = ["attention_kernel_available", "attention_kernel_status", "invariant_attention", "kernel_supports",
           "use_invariant_kernel"]

_SOURCE = Path(__file__).with_name("attention.cpp")
# -ffp-contract=off: no multiply-add fused behind the code's back; the FMAs it has are written out.
_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _self_check(op) -> str:
    """The kernel against SDPA (fp32, repeated kv heads) with a random mask, a causal block and one row."""
    g = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, tokens, slots, dh in ((2, 6, 2, 5, 37, 16), (1, 4, 4, 1, 9, 8), (1, 2, 1, 7, 7, 24)):
        q = torch.randn(batch, heads, tokens, dh, generator=g)
        k = torch.randn(batch, kv_heads, slots, dh, generator=g)
        v = torch.randn(batch, kv_heads, slots, dh, generator=g)
        mask = torch.rand(batch, tokens, slots, generator=g) > 0.4
        mask[..., 0] = True
        causal = tokens == slots
        ref_mask = torch.ones(tokens, slots, dtype=torch.bool).tril() if causal else mask[:, None]
        group = heads // kv_heads
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=ref_mask)
        got = op(q, k, v, None if causal else mask, causal, 1.0 / math.sqrt(dh))
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-5):
            err = (got - ref).abs().max().item()
            return f"attention self-check failed for B={batch} H={heads}/{kv_heads} T={tokens} S={slots} " \
                   f"(max abs err {err:.3g})"
    return ""


def _load() -> tuple[bool, str, object]:
    lanes = "AVX2/FMA" if platform.cpu().missing(("avx512f", "avx512bw", "avx512vl", "avx512dq")) else "AVX-512 lanes"
    if not platform.cpu().missing(("avx512_bf16",)):
        lanes += "; bf16 on AVX512-BF16 dot products"
    return jit.jit_load("attention", "dflash2_attention", _SOURCE, _CFLAGS, "dflash2_attention.attention_rows",
                        _self_check, label=f"row-invariant attention ({lanes}) ")


def _ensure_loaded() -> None:
    jit.ensure_loaded(_state, _lock, _load, "row-invariant attention kernel")


def attention_kernel_available() -> bool:
    """True when the kernel is built, loaded and passed its self-check (the first call builds it)."""
    _ensure_loaded()
    return bool(_state["available"])


def attention_kernel_status() -> str:
    """One line: where the kernel was loaded from, or why it is not available."""
    _ensure_loaded()
    return str(_state["status"])


def use_invariant_kernel() -> bool:
    """False when ``DFLASH2_ATTENTION=torch`` (or off) asks for PyTorch's attention (the setting parsed once:
    :func:`dflash2.platform.settings`)."""
    return not platform.settings().attention.off


def kernel_supports(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """The call is one the kernel takes: CPU, fp32 / bf16 / fp16, head dim a multiple of 8, a bool mask (or none)
    with one head row; and the kernel is available."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k.dtype == q.dtype
        and q.shape[-1] % 8 == 0
        and (attn_mask is None or (attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1))
        and attention_kernel_available()
    )


def kernel_mask(attn_mask: torch.Tensor) -> torch.Tensor:
    """[B or 1, 1, T or 1, S] bool -> [B or 1, T or 1, S] with a contiguous last axis: the mask as the kernel takes
    it (``invariant_attention``, and the fused gguf layer once per forward)."""
    mask = attn_mask[:, 0]
    return mask if mask.stride(-1) == 1 else mask.contiguous()


def invariant_attention(
    q: torch.Tensor,  # [B, H, T, Dh] fp32, bf16 or fp16
    k: torch.Tensor,  # [B, H_kv, S, Dh]
    v: torch.Tensor,  # [B, H_kv, S, Dh]
    attn_mask: torch.Tensor | None = None,  # [B or 1, 1, T or 1, S] bool, True = may attend; None = all (or causal)
    is_causal: bool = False,  # query t also sees no slot past S - T + t
) -> torch.Tensor:  # [B, H, T, Dh] in q's dtype
    """Softmax(q k^T / sqrt(Dh)) v with grouped-query heads, each row computed in one fixed order (see module doc).

    A row with no visible slot gives zeros (SDPA gives NaN). Arguments the kernel does not take raise
    :class:`~dflash2.kernels.boundary.KernelInputError`."""
    check_attention(q, k, v, attn_mask)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    mask = None if attn_mask is None else kernel_mask(attn_mask)
    out = _state["op"](q, k, v, mask, is_causal, 1.0 / math.sqrt(q.shape[-1]))  # fp32 [B, H, T, Dh]
    return out if q.dtype == torch.float32 else out.to(q.dtype)
