"""The grouped-head fold of :func:`dflash2.models.attention.attend` against PyTorch's own GQA attention."""

import pytest
import torch
import torch.nn.functional as F

from dflash2.models.attention import FOLD_MAX_QUERIES, attend


def _inputs(batch: int, heads: int, kv_heads: int, tokens: int, slots: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(tokens * 100 + slots)
    q = torch.randn(batch, heads, tokens, 16, generator=gen, dtype=dtype)
    k = torch.randn(batch, kv_heads, slots, 16, generator=gen, dtype=dtype)
    v = torch.randn(batch, kv_heads, slots, 16, generator=gen, dtype=dtype)
    return q, k, v


def _reference(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("mask_kind", ["none", "per_row", "shared", "broadcast_queries"])
def test_folded_heads_equal_repeated_kv_heads(tokens: int, mask_kind: str) -> None:
    batch, slots = 3, 11
    q, k, v = _inputs(batch, 6, 2, tokens, slots)
    gen = torch.Generator().manual_seed(7)
    mask = {
        "none": None,
        "per_row": torch.rand(batch, 1, tokens, slots, generator=gen) > 0.3,
        "shared": torch.rand(1, 1, tokens, slots, generator=gen) > 0.3,
        "broadcast_queries": torch.rand(batch, 1, 1, slots, generator=gen) > 0.3,
    }[mask_kind]
    if mask is not None:
        mask[..., 0] = True  # every query sees at least one slot
    torch.testing.assert_close(attend(q, k, v, mask), _reference(q, k, v, mask), rtol=1e-12, atol=1e-12)


def test_causal_and_long_blocks_take_the_unfolded_path_with_the_same_result() -> None:
    q, k, v = _inputs(1, 4, 2, FOLD_MAX_QUERIES + 1, FOLD_MAX_QUERIES + 1)
    causal = torch.ones(FOLD_MAX_QUERIES + 1, FOLD_MAX_QUERIES + 1, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attend(q, k, v, is_causal=True), _reference(q, k, v, causal), rtol=1e-12, atol=1e-12)


def test_a_row_of_a_bf16_block_equals_that_row_attended_alone() -> None:
    """Verification (a block of queries) must round like decoding (one query at a time)."""
    tokens, slots = 8, 300
    q, k, v = _inputs(1, 12, 2, tokens, slots, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, tokens, slots, dtype=torch.bool).tril(slots - tokens)
    block = attend(q, k, v, mask)
    for i in range(tokens):
        visible = slots - tokens + i + 1
        alone = attend(q[:, :, i : i + 1], k[:, :, :visible], v[:, :, :visible])
        assert torch.equal(alone, block[:, :, i : i + 1]), f"query {i}"


def test_training_gets_gradients_through_attention():
    """The row-invariant kernel has no backward: a call that needs gradients takes PyTorch's path (drafter
    training), and its gradients are those of the reference attention."""
    import torch

    from dflash2.models.attention import attend, torch_attend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 5, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 5, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 5, 16, generator=g, requires_grad=True)
    attend(q, k, v, is_causal=True).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch_attend(q, k, v, is_causal=True).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
