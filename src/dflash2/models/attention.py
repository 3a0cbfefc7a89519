"""Scaled dot-product attention with grouped-query heads.

On CPU, fp32, bf16 and fp16 calls go to the row-invariant kernel (:mod:`dflash2.kernels.attention`): a query
row's output is bitwise the same whatever the number of rows in the call, the mask, the padding or the batch, so
verifying a block of drafts rounds exactly like decoding it one token at a time (greedy speculative output == plain
output, in bf16 too; docs/attention.md). ``DFLASH2_ATTENTION=torch`` (or ``DFLASH2_KERNELS=off``, or a missing
kernel) selects PyTorch's attention below instead; CUDA and other dtypes always use it.

The PyTorch path: decoding (1 query), verification (a draft block) and block drafting all attend a handful of
queries to a long cache. With grouped-query attention, PyTorch's CPU kernel for ``enable_gqa=True`` is slow for a single
query: measured on this 2-core AVX2 machine (bf16, 12 query / 2 KV heads, Dh 128), one query over 481 cached
slots in 16 rows costs 16.4 ms per layer, against 1.2 ms when the query heads that share a KV head are folded
into the query axis ([B, H, T, Dh] -> [B, H_kv, G * T, Dh]) and attended as plain multi-head attention. At one
row and 1000 slots: 2.3 ms -> 0.16 ms. The fold changes which kernel runs, not the math: outputs equal the
unfolded call bitwise in the measured cases (bf16 and fp32), and a row of a block still equals that row
attended alone, as before. Long query blocks (prefill) keep the unfolded call, where the fold gains nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash2.kernels import attention as _kernel

FOLD_MAX_QUERIES = 64  # fold grouped heads into the query axis up to this many queries per row


def attend(
    q: torch.Tensor,  # [B, H, T, Dh]
    k: torch.Tensor,  # [B, H_kv, S, Dh]
    v: torch.Tensor,  # [B, H_kv, S, Dh]
    attn_mask: torch.Tensor | None = None,  # [B or 1, 1, T or 1, S] bool, True = may attend; None = all (or causal)
    is_causal: bool = False,
) -> torch.Tensor:  # [B, H, T, Dh]
    trains = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if _kernel.use_invariant_kernel() and not trains and _kernel.kernel_supports(q, k, attn_mask):
        return _kernel.invariant_attention(q, k, v, attn_mask, is_causal)
    return torch_attend(q, k, v, attn_mask, is_causal)  # also training: the kernel has no backward


def torch_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                 is_causal: bool = False) -> torch.Tensor:
    """:func:`attend` on PyTorch's SDPA (same arguments), grouped heads folded into the query axis for short blocks
    (module doc)."""
    batch, heads, tokens, head_dim = q.shape
    kv_heads = k.shape[1]
    if heads == kv_heads:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
    if is_causal or tokens > FOLD_MAX_QUERIES:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=True)
    group = heads // kv_heads
    folded = q.reshape(batch, kv_heads, group * tokens, head_dim)  # query head h = kv head h // G, then g
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=_fold_mask(attn_mask, group, tokens))
    return out.view(batch, heads, tokens, head_dim)


def _fold_mask(mask: torch.Tensor | None, group: int, tokens: int) -> torch.Tensor | None:
    """[B', 1, T, S] -> [B', 1, G * T, S] (the same rows for every folded head); a mask broadcast over the
    queries ([B', 1, 1, S]) or None is kept as it is."""
    if mask is None or mask.shape[-2] == 1:
        return mask
    rows, _, _, slots = mask.shape
    return mask[:, :, None].expand(rows, 1, group, tokens, slots).reshape(rows, 1, group * tokens, slots)


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding-window layer's limit (Gemma 3's local layers): the query at position p sees only the keys at
    positions k with p - k < size (and k <= p, which the causal or tree mask already says).

    By positions, not slots, so one rule serves a chain, a tree (a node's position is the cache length plus its
    depth) and the paged pool (a row's committed slots hold positions 0 .. length - 1)."""

    size: int
    positions: torch.Tensor  # [B, T] int64, the forward's query positions

    def restrict(self, mask: torch.Tensor, key_positions: torch.Tensor, query_positions: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """mask [B or 1, 1, T, S] bool and key_positions [B or 1, S] -> the mask with the keys outside every query's
        window cleared ([B, 1, T, S]); query_positions [B, T] (default: this forward's positions)."""
        queries = self.positions if query_positions is None else query_positions
        inside = (queries[:, :, None] - key_positions[:, None, :]) < self.size  # [B, T, S]
        return mask & inside[:, None]
