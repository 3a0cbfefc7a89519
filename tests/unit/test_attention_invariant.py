"""The row-invariant attention kernel (dflash2.kernels.attention): a query row's output is bitwise the same whatever
else is in the call (row count, causal / tree mask, padding, batch companions, paged layout, threads), and close to
PyTorch's SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels.attention import attention_kernel_available, attention_kernel_status, invariant_attention
from dflash2.models.attention import attend, torch_attend
from dflash2.platform import cpu, reload_settings

pytestmark = pytest.mark.skipif(not attention_kernel_available(),
                                reason=f"attention kernel unavailable: {attention_kernel_status()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HEADS = 6, 2  # grouped: 3 query heads per kv head
DH = 32


def _qkv(batch: int, tokens: int, slots: int, dtype: torch.dtype, seed: int = 0, heads=HEADS, dh=DH):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads[0], tokens, dh, generator=g).to(dtype)
    k = torch.randn(batch, heads[1], slots, dh, generator=g).to(dtype)
    v = torch.randn(batch, heads[1], slots, dh, generator=g).to(dtype)
    return q, k, v


def _alone(q, k, v, b: int, t: int, visible: torch.Tensor) -> torch.Tensor:
    """Row (b, t) attended alone over its visible slots, gathered into a contiguous cache: [H, Dh]."""
    slots = visible.nonzero()[:, 0]
    return attend(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, slots], v[b : b + 1, :, slots])[0, :, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_row_of_a_causal_block_equals_the_row_alone_for_1_to_17_rows(dtype) -> None:
    cached = 41
    for tokens in range(1, 18):
        q, k, v = _qkv(1, tokens, cached + tokens, dtype, seed=tokens)
        slots = cached + tokens
        mask = torch.ones(1, 1, tokens, slots, dtype=torch.bool).tril(cached)
        block = attend(q, k, v, mask)
        for t in range(tokens):
            alone = attend(q[:, :, t : t + 1], k[:, :, : cached + t + 1], v[:, :, : cached + t + 1])
            assert torch.equal(block[:, :, t : t + 1], alone), f"{tokens} rows, row {t}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_is_causal_equals_the_explicit_mask_and_prefill_chunks(dtype) -> None:
    tokens = 23
    q, k, v = _qkv(1, tokens, tokens, dtype)
    causal = attend(q, k, v, is_causal=True)
    explicit = attend(q, k, v, torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril())
    assert torch.equal(causal, explicit)
    for start, end in ((0, 7), (7, 16), (16, 23)):  # a chunked prefill: each chunk over the cache so far
        chunk = attend(q[:, :, start:end], k[:, :, :end], v[:, :, :end], is_causal=True)
        assert torch.equal(chunk, causal[:, :, start:end])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_rows_equal_their_path_attended_alone(dtype) -> None:
    """A tree node sees the prefix and its ancestors at scattered slots; alone, the same keys are contiguous."""
    cached, parents = 30, [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8]  # node i's parent (-1: child of the last committed token)
    nodes = len(parents)
    q, k, v = _qkv(1, nodes, cached + nodes, dtype, seed=3)
    mask = torch.zeros(1, 1, nodes, cached + nodes, dtype=torch.bool)
    mask[..., :cached] = True
    for i in range(nodes):
        j = i
        while j >= 0:
            mask[0, 0, i, cached + j] = True
            j = parents[j]
    block = attend(q, k, v, mask)
    for i in range(nodes):
        assert torch.equal(block[0, :, i], _alone(q, k, v, 0, i, mask[0, 0, i])), f"node {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_ragged_batch_rows_equal_each_row_alone(dtype) -> None:
    """The server's ragged forward: rows of different lengths padded to [B, T_max] over [B, S_max] keys."""
    spans, lengths = (19, 50, 7, 33), (3, 1, 7, 5)  # visible slots and new tokens per row
    batch, t_max, s_max = len(spans), max(lengths), max(spans)
    q, k, v = _qkv(batch, t_max, s_max, dtype, seed=5)
    mask = torch.zeros(batch, 1, t_max, s_max, dtype=torch.bool)
    mask[:, 0, :, 0] = True  # padding queries see one slot
    for r, (span, n) in enumerate(zip(spans, lengths)):
        mask[r, 0, :n, :span] = torch.ones(n, span, dtype=torch.bool).tril(span - n)
    block = attend(q, k, v, mask)
    for r, n in enumerate(lengths):
        for t in range(n):
            assert torch.equal(block[r, :, t], _alone(q, k, v, r, t, mask[r, 0, t])), f"row {r} token {t}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_layout_gathered_keys_equal_a_contiguous_cache(dtype) -> None:
    """Keys gathered from scattered pool slots ([N, H_kv, Dh] rows, transposed views) equal a contiguous cache."""
    slots, tokens = 45, 4
    q, k, v = _qkv(1, tokens, slots, dtype, seed=9)
    pool_k = torch.randn(200, HEADS[1], DH).to(dtype)
    pool_v = torch.randn(200, HEADS[1], DH).to(dtype)
    where = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:slots]
    pool_k[where], pool_v[where] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    paged_k = pool_k.index_select(0, where).view(1, slots, HEADS[1], DH).transpose(1, 2)  # strided view
    paged_v = pool_v.index_select(0, where).view(1, slots, HEADS[1], DH).transpose(1, 2)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, Dh] with T-major memory
    mask = torch.ones(1, 1, tokens, slots, dtype=torch.bool).tril(slots - tokens)
    assert torch.equal(attend(q_strided, paged_k, paged_v, mask), attend(q, k, v, mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_companions_and_broadcast_masks_do_not_change_a_row(dtype) -> None:
    q, k, v = _qkv(3, 5, 27, dtype, seed=2)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(1, 1, 5, 27, generator=g) > 0.3
    mask[..., 0] = True
    both = attend(q, k, v, mask)  # one mask broadcast over the batch
    assert torch.equal(both[1:2], attend(q[1:2], k[1:2], v[1:2], mask))
    row_mask = mask[:, :, 2:3]  # [1, 1, 1, S]: broadcast over queries
    assert torch.equal(attend(q, k, v, row_mask)[:, :, 2], both[:, :, 2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_the_result(dtype) -> None:
    q, k, v = _qkv(2, 9, 700, dtype, seed=6, heads=(12, 2), dh=128)
    mask = torch.ones(1, 1, 9, 700, dtype=torch.bool).tril(691)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attend(q, k, v, mask)
        torch.set_num_threads(2)
        two = attend(q, k, v, mask)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dh", [((12, 2), 128), ((4, 4), 16), ((14, 2), 64), ((8, 1), 24)])
def test_close_to_sdpa(dtype, heads, dh) -> None:
    tokens, slots = 6, 300
    q, k, v = _qkv(2, tokens, slots, dtype, seed=8, heads=heads, dh=dh)
    mask = torch.ones(1, 1, tokens, slots, dtype=torch.bool).tril(slots - tokens)
    group = heads[0] // heads[1]
    ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 1),
                                         v.double().repeat_interleave(group, 1), attn_mask=mask)
    got = invariant_attention(q, k, v, mask)
    assert got.dtype == dtype
    tol = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]  # the output's rounding dominates
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


def test_the_softmax_max_is_the_true_max_wherever_it_lies() -> None:
    """Scores spread over thousands (a max off by one score's gap over- or underflows 2^(s - max)): one large key at
    every position class of the max's reduction (first, inside the 32-wide chains, in their last lanes, in the tail)
    for slot counts below, at and past the vector loop; the result equals SDPA in fp64."""
    dh = 32
    for slots in (7, 31, 32, 33, 64, 95, 129):
        for big in sorted({0, 5, 17, 31, slots // 2, slots - 1} - {s for s in range(slots, 200)}):
            q = torch.full((1, 1, 1, dh), 4.0)
            k = torch.randn(1, 1, slots, dh, generator=torch.Generator().manual_seed(slots + big))
            k[0, 0, big] = 30.0  # the max score (~2e4 * scale) far above the rest
            v = torch.randn(1, 1, slots, dh, generator=torch.Generator().manual_seed(big))
            ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
            got = invariant_attention(q, k, v, None)
            assert torch.isfinite(got).all(), (slots, big)
            torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=2e-6, msg=f"{slots} slots, max at {big}")


@pytest.mark.skipif(bool(cpu().missing(("avx512f", "avx512bw", "avx512vl", "avx512dq"))), reason="no AVX-512")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_16_lane_functions_give_the_8_lane_bits(dtype) -> None:
    """Where the CPU has AVX-512 the kernel runs its chains two per 512-bit vector: bitwise the AVX2 path, for
    every head group size and dims-per-pass variant, odd key counts (a last key on 8 lanes), masks and causal."""
    from dflash2.kernels import attention

    op = attention._state["op"]
    for heads, dh, slots in (((12, 2), 128, 209), ((14, 2), 64, 301), ((8, 1), 32, 7), ((16, 2), 16, 40),
                             ((4, 4), 48, 1), ((9, 3), 128, 66)):
        q, k, v = _qkv(2, 5, slots, dtype, seed=dh + slots, heads=heads, dh=dh)
        mask = torch.rand(2, 5, slots, generator=torch.Generator().manual_seed(slots)) > 0.3
        for m, causal in ((None, True), (mask, False)):
            args = (q, k, v, m, causal, dh ** -0.5)
            wide, narrow = op(*args, 16), op(*args, 8)
            assert torch.equal(wide, narrow), (heads, dh, slots, causal)
            if not _dots(dtype, dh):
                assert torch.equal(op(*args), wide)  # the default here


def _dots(dtype: torch.dtype, dh: int) -> bool:
    """Whether the default takes the bf16 dot products here (AVX512-BF16, bf16, head dim a multiple of 32)."""
    return dtype == torch.bfloat16 and dh % 32 == 0 and "avx512_bf16" in cpu().flags


needs_bf16_dots = pytest.mark.skipif("avx512_bf16" not in cpu().flags, reason="no AVX512-BF16")


@needs_bf16_dots
def test_bf16_dot_products_are_the_default_for_bf16_and_close_to_sdpa() -> None:
    """lanes=32 (VDPBF16PS): the default for bf16 q / k / v here; its own bits (another order than the fp32 chains),
    within the bf16 tolerance of SDPA in fp64 for odd and even key counts, grouped heads and masks."""
    from dflash2.kernels import attention

    op = attention._state["op"]
    for heads, dh, slots in (((12, 2), 128, 209), ((14, 2), 64, 301), ((8, 1), 32, 7), ((4, 4), 96, 1),
                             ((9, 3), 128, 66)):
        q, k, v = _qkv(2, 5, slots, torch.bfloat16, seed=dh + slots, heads=heads, dh=dh)
        mask = torch.rand(2, 5, slots, generator=torch.Generator().manual_seed(slots)) > 0.3
        mask[..., 0] = True
        for m, causal in ((None, True), (mask, False)):
            args = (q, k, v, m, causal, dh ** -0.5)
            dots = op(*args, 32)
            assert torch.equal(op(*args), dots), (heads, dh, slots)
            visible = mask[:, None] if m is not None else torch.ones(5, slots, dtype=torch.bool).tril(slots - 5)
            group = heads[0] // heads[1]
            ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(group, 1),
                                                 v.double().repeat_interleave(group, 1), attn_mask=visible)
            torch.testing.assert_close(dots.double(), ref, rtol=8e-3, atol=8e-3)
    with pytest.raises(RuntimeError, match="lanes"):
        op(q.float(), k.float(), v.float(), None, True, 0.1, 32)  # bf16 only


@needs_bf16_dots
def test_bf16_dot_products_keep_a_row_the_same_in_any_block_and_tree() -> None:
    """Row invariance of the VDPBF16PS path forced (lanes=32): each row of causal blocks of 1..17 rows over odd and
    even cached lengths (short and past 128 keys) equals the row alone, and a tree row equals its path attended
    alone."""
    from dflash2.kernels import attention

    op = attention._state["op"]
    heads, dh = (12, 2), 128
    for cached in (40, 41, 126, 129):
        for tokens in (1, 2, 5, 9, 17):
            q, k, v = _qkv(1, tokens, cached + tokens, torch.bfloat16, seed=tokens + cached, heads=heads, dh=dh)
            block = op(q, k, v, None, True, dh ** -0.5, 32)
            for t in range(tokens):
                n = cached + t + 1
                alone = op(q[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], None, True, dh ** -0.5, 32)
                assert torch.equal(block[:, :, t : t + 1], alone), (cached, tokens, t)
    q, k, v = _qkv(1, 4, 30, torch.bfloat16, seed=3, heads=heads, dh=dh)
    mask = torch.zeros(1, 4, 30, dtype=torch.bool)
    mask[0, :, :26] = True
    mask[0, 1, 26], mask[0, 2, [26, 27]], mask[0, 3, [26, 28]] = True, True, True  # a tree over 26 cached slots
    tree = op(q, k, v, mask, False, dh ** -0.5, 32)
    for t in range(4):
        slots = mask[0, t].nonzero()[:, 0]
        alone = op(q[:, :, t : t + 1], k[:, :, slots], v[:, :, slots], None, False, dh ** -0.5, 32)
        assert torch.equal(tree[:, :, t : t + 1], alone), t


def test_a_row_with_no_visible_slot_gives_zeros() -> None:
    q, k, v = _qkv(1, 2, 5, torch.float32)
    mask = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    mask[0, 0, 1, :3] = True
    out = invariant_attention(q, k, v, mask)
    assert torch.equal(out[0, :, 0], torch.zeros(HEADS[0], DH))
    assert torch.isfinite(out).all()


def test_the_switch_selects_torch_attention(monkeypatch) -> None:
    q, k, v = _qkv(1, 3, 40, torch.bfloat16)
    mask = torch.ones(1, 1, 3, 40, dtype=torch.bool).tril(37)
    monkeypatch.setenv("DFLASH2_ATTENTION", "torch")
    reload_settings()
    assert torch.equal(attend(q, k, v, mask), torch_attend(q, k, v, mask))
    monkeypatch.delenv("DFLASH2_ATTENTION")
    reload_settings()
    assert torch.equal(attend(q, k, v, mask), invariant_attention(q, k, v, mask))
