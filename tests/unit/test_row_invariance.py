"""Row invariance, the contract that makes speculative greedy output equal plain greedy output in bf16: every op a
decoder row goes through, the attention kernel, and the whole decoder (a block, a tree, a chunked prefill, the server's
ragged batch) give a row bitwise the same result whatever else is computed with it (1..17 rows, as in decoding,
verification and tree verification), in bf16 and fp32, on 1 and 2 threads. docs/attention.md has the audit.

Sections: the ops (norms, rotary, residuals, SwiGLU, packed projections, embedding, sampling warps) at the sizes of
Qwen2.5-Coder-1.5B; the row-invariant attention kernel (close to PyTorch's SDPA too); the decoder on tiny random
models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.decode.batch import BatchConfig, BatchEngine, BatchRequest, request_drafters, run_to_completion
from dflash2.decode.engine import Engine
from dflash2.decode.ragged import RaggedRow, WorkspaceCost, build_layout, ragged_forward
from dflash2.decode.stats import DecodeStats
from dflash2.drafters.model import ModelDrafter
from dflash2.drafters.ngram import NgramDrafter
from dflash2.kernels import PackedLinear, kernel_status, kernels_available
from dflash2.kernels.attention import attention_kernel_available, attention_kernel_status, invariant_attention
from dflash2.kernels.layer_ops import rotate_half
from dflash2.kv.paged import PagedKVPool
from dflash2.models.attention import attend, torch_attend
from dflash2.models.decoder import RMSNorm
from dflash2.models.loading import load_transformer
from dflash2.platform import cpu, reload_settings
from dflash2.verify.sampling import SamplingParams, logits_to_probs
from dflash2.verify.tree import compile_tree, target_positions, tree_attention_mask
from tests.pipelines import PIPELINES
from tests.unit.decode.test_batch_engine import IdTokenizer, prompts, single
from tests.unit.decode.test_speculative_greedy import NEW_TOKENS, RandomDrafter, plain_ids, repetitive_prompt, spec_ids

needs_attention_kernel = pytest.mark.skipif(not attention_kernel_available(),
                                            reason=f"attention kernel unavailable: {attention_kernel_status()}")


# ---- the ops -------------------------------------------------------------------------------------------------------
ROWS = range(1, 18)
OP_DTYPES = [torch.bfloat16, torch.float32]
HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 1536, 8960, 12, 128  # Qwen2.5-Coder-1.5B


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_rows_invariant(op, *xs: torch.Tensor) -> None:
    """op maps row-aligned [1, n, ...] tensors to [1, n, ...] (or [1, n]): every row of op(x[:, :n]) equals op of that
    row alone."""
    alone = torch.cat([op(*(x[:, i : i + 1] for x in xs)) for i in range(xs[0].shape[1])], dim=1)
    for n in ROWS:
        block = op(*(x[:, :n] for x in xs))
        assert torch.equal(block, alone[:, :n]), f"{n} rows: {(block != alone[:, :n]).nonzero()[:3].tolist()}"


def _randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_rmsnorm(dtype, threads) -> None:
    norm = RMSNorm(HIDDEN, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(HIDDEN, dtype=dtype, seed=1))
        assert_rows_invariant(norm, _randn(1, 17, HIDDEN, dtype=dtype) * 3)


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_rotary_on_the_decoder_and_the_ragged_layouts(dtype, threads) -> None:
    positions = torch.arange(500, 517)
    angles = positions.float()[:, None] * (1.0 / 1e6 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.cat((angles, angles), -1)[None]  # [1, 17, Dh]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = _randn(1, 17, HEADS, HEAD_DIM, dtype=dtype)

    def decoder_layout(x, c, s):  # q as [1, H, n, Dh], cos as [1, 1, n, Dh] (Attention.forward)
        qh, c, s = x.transpose(1, 2), c[:, None], s[:, None]
        return (qh * c + rotate_half(qh) * s).transpose(1, 2)

    def ragged_layout(x, c, s):  # q as [n, H, Dh], cos as [n, 1, Dh] (decode/ragged.py)
        return (x[0] * c[0, :, None] + rotate_half(x[0]) * s[0, :, None])[None]

    assert_rows_invariant(decoder_layout, q, cos, sin)
    assert_rows_invariant(ragged_layout, q, cos, sin)


@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_residual_add_and_swiglu_on_split_views(dtype, threads) -> None:
    gate_up = _randn(1, 17, 2 * INTERMEDIATE, dtype=dtype) * 2  # the fused projection's output, split as views

    def swiglu(x):
        gate, up = x.split(INTERMEDIATE, dim=-1)
        return F.silu(gate) * up

    assert_rows_invariant(swiglu, gate_up)
    other = _randn(1, 17, HIDDEN, dtype=dtype, seed=2)
    assert_rows_invariant(torch.add, _randn(1, 17, HIDDEN, dtype=dtype), other)


@pytest.mark.skipif(not kernels_available(), reason=f"packed kernel unavailable: {kernel_status()}")
@pytest.mark.parametrize("dtype", OP_DTYPES)
def test_packed_head_and_projections(dtype, threads) -> None:
    for out_features in (4096 + 7, 2 * INTERMEDIATE // 8):
        layer = PackedLinear.from_weight(_randn(out_features, HIDDEN, dtype=torch.float32, seed=3) / 40)
        assert_rows_invariant(layer, _randn(1, 17, HIDDEN, dtype=dtype))


def test_embedding_gather(threads) -> None:
    embed = torch.nn.Embedding(1000, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 1000, (1, 17), generator=torch.Generator().manual_seed(0))
    assert_rows_invariant(embed, ids)


WARPS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=50),
         SamplingParams(temperature=0.8, top_p=0.9)]


@pytest.mark.parametrize("params", WARPS, ids=["greedy", "t0.7", "top_k", "top_p"])
def test_sampling_warp_and_argmax(params, threads) -> None:
    # top-p renormalises by a serial scan per row: probs.sum(-1) split a lone 151936-wide row across two threads
    logits = _randn(1, 17, 151936, dtype=torch.float32) * 4  # the head's fp32 logits, Qwen's vocabulary
    assert_rows_invariant(lambda x: logits_to_probs(x, params), logits)
    assert_rows_invariant(lambda x: x.argmax(-1), logits)


# ---- the attention kernel ------------------------------------------------------------------------------------------
ATTENTION_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GROUPED_HEADS = 6, 2  # grouped: 3 query heads per kv head
DH = 32


def _qkv(batch: int, tokens: int, slots: int, dtype: torch.dtype, seed: int = 0, heads=GROUPED_HEADS, dh=DH):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads[0], tokens, dh, generator=g).to(dtype)
    k = torch.randn(batch, heads[1], slots, dh, generator=g).to(dtype)
    v = torch.randn(batch, heads[1], slots, dh, generator=g).to(dtype)
    return q, k, v


def _alone(q, k, v, b: int, t: int, visible: torch.Tensor) -> torch.Tensor:
    """Row (b, t) attended alone over its visible slots, gathered into a contiguous cache: [H, Dh]."""
    slots = visible.nonzero()[:, 0]
    return attend(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, slots], v[b : b + 1, :, slots])[0, :, 0]


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_is_causal_equals_the_explicit_mask_and_prefill_chunks(dtype) -> None:
    tokens = 23
    q, k, v = _qkv(1, tokens, tokens, dtype)
    causal = attend(q, k, v, is_causal=True)
    explicit = attend(q, k, v, torch.ones(1, 1, tokens, tokens, dtype=torch.bool).tril())
    assert torch.equal(causal, explicit)
    for start, end in ((0, 7), (7, 16), (16, 23)):  # a chunked prefill: each chunk over the cache so far
        chunk = attend(q[:, :, start:end], k[:, :, :end], v[:, :, :end], is_causal=True)
        assert torch.equal(chunk, causal[:, :, start:end])


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_paged_layout_gathered_keys_equal_a_contiguous_cache(dtype) -> None:
    """Keys gathered from scattered pool slots ([N, H_kv, Dh] rows, transposed views) equal a contiguous cache."""
    slots, tokens = 45, 4
    q, k, v = _qkv(1, tokens, slots, dtype, seed=9)
    pool_k = torch.randn(200, GROUPED_HEADS[1], DH).to(dtype)
    pool_v = torch.randn(200, GROUPED_HEADS[1], DH).to(dtype)
    where = torch.randperm(200, generator=torch.Generator().manual_seed(1))[:slots]
    pool_k[where], pool_v[where] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    paged_k = pool_k.index_select(0, where).view(1, slots, GROUPED_HEADS[1], DH).transpose(1, 2)  # strided view
    paged_v = pool_v.index_select(0, where).view(1, slots, GROUPED_HEADS[1], DH).transpose(1, 2)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, T, Dh] with T-major memory
    mask = torch.ones(1, 1, tokens, slots, dtype=torch.bool).tril(slots - tokens)
    assert torch.equal(attend(q_strided, paged_k, paged_v, mask), attend(q, k, v, mask))


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
def test_batch_companions_and_broadcast_masks_do_not_change_a_row(dtype) -> None:
    q, k, v = _qkv(3, 5, 27, dtype, seed=2)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(1, 1, 5, 27, generator=g) > 0.3
    mask[..., 0] = True
    both = attend(q, k, v, mask)  # one mask broadcast over the batch
    assert torch.equal(both[1:2], attend(q[1:2], k[1:2], v[1:2], mask))
    row_mask = mask[:, :, 2:3]  # [1, 1, 1, S]: broadcast over queries
    assert torch.equal(attend(q, k, v, row_mask)[:, :, 2], both[:, :, 2])


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
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


@needs_attention_kernel
@pytest.mark.skipif(bool(cpu().missing(("avx512f", "avx512bw", "avx512vl", "avx512dq"))), reason="no AVX-512")
@pytest.mark.parametrize("dtype", ATTENTION_DTYPES)
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


@needs_attention_kernel
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


@needs_attention_kernel
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


@needs_attention_kernel
@needs_bf16_dots
@pytest.mark.parametrize("heads,dh", [((12, 2), 128), ((14, 2), 64), ((9, 1), 64), ((4, 4), 96)])
def test_rows_over_long_cached_keys_equal_each_row_alone(heads, dh) -> None:
    """Over hundreds of cached keys (a long prompt's verification) each row of the VDPBF16PS path gives the bits it
    gives alone: chains of 2..17 rows over odd and even cached lengths, a tree over a long prefix beside a shorter
    padded row of a ragged batch, and groups of more query heads per kv head than one pass over the keys takes (9)."""
    from dflash2.kernels import attention

    op = attention._state["op"]
    scale = dh ** -0.5
    for cached in (256, 257, 700, 1031):
        for tokens in (2, 3, 9, 17):
            q, k, v = _qkv(1, tokens, cached + tokens, torch.bfloat16, seed=tokens + cached, heads=heads, dh=dh)
            block = op(q, k, v, None, True, scale, 32)
            for t in range(tokens):
                n = cached + t + 1
                alone = op(q[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], None, True, scale, 32)
                assert torch.equal(block[:, :, t : t + 1], alone), (heads, cached, tokens, t)
    slots = 600
    q, k, v = _qkv(2, 5, slots, torch.bfloat16, seed=5, heads=heads, dh=dh)
    mask = torch.zeros(2, 5, slots, dtype=torch.bool)
    mask[0, :, :590] = True  # a tree over 590 cached slots: root, two children, a grandchild
    mask[0, 1, 590], mask[0, 2, [590, 591]], mask[0, 3, [590, 592]], mask[0, 4, [590, 592, 593]] = True, True, True, True
    mask[1, :, :200] = True  # a shorter padded row
    mask[1, :, 300:304] = torch.ones(5, 4, dtype=torch.bool).tril()
    tree = op(q, k, v, mask, False, scale, 32)
    for b in range(2):
        for t in range(5):
            visible = mask[b, t].nonzero()[:, 0]
            alone = op(q[b : b + 1, :, t : t + 1], k[b : b + 1, :, visible], v[b : b + 1, :, visible], None, False,
                       scale, 32)
            assert torch.equal(tree[b : b + 1, :, t : t + 1], alone), (heads, b, t)


@needs_attention_kernel
def test_a_row_with_no_visible_slot_gives_zeros() -> None:
    q, k, v = _qkv(1, 2, 5, torch.float32)
    mask = torch.zeros(1, 1, 2, 5, dtype=torch.bool)
    mask[0, 0, 1, :3] = True
    out = invariant_attention(q, k, v, mask)
    assert torch.equal(out[0, :, 0], torch.zeros(GROUPED_HEADS[0], DH))
    assert torch.isfinite(out).all()


@needs_attention_kernel
def test_the_switch_selects_torch_attention(monkeypatch) -> None:
    q, k, v = _qkv(1, 3, 40, torch.bfloat16)
    mask = torch.ones(1, 1, 3, 40, dtype=torch.bool).tril(37)
    monkeypatch.setenv("DFLASH2_ATTENTION", "torch")
    reload_settings()
    assert torch.equal(attend(q, k, v, mask), torch_attend(q, k, v, mask))
    monkeypatch.delenv("DFLASH2_ATTENTION")
    reload_settings()
    assert torch.equal(attend(q, k, v, mask), invariant_attention(q, k, v, mask))


# ---- the decoder ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tiny_model_dirs):
    return {key: load_transformer(path, "bf16") for key, path in tiny_model_dirs.items()}


@pytest.fixture(params=PIPELINES)
def pipeline(request) -> str:
    return request.param


def _prompt(length: int = 29) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length))


def _one_at_a_time(model, cache, tokens: list[int]) -> torch.Tensor:
    """Logits [T, V] of ``tokens`` fed one per forward (plain decoding)."""
    return torch.cat([model(torch.tensor([[t]]), cache=cache).logits[0] for t in tokens])


@needs_attention_kernel
@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_a_block_of_1_to_17_tokens_gives_the_logits_of_one_token_at_a_time(models, key) -> None:
    model, prompt = models[key], _prompt()
    cache = model.new_cache(64)
    model(prompt[None], cache=cache, logits="none")
    block = _prompt(17).tolist()
    alone = _one_at_a_time(model, cache, block)
    for tokens in range(1, 18):
        cache.rollback(len(prompt))
        got = model(torch.tensor([block[:tokens]]), cache=cache).logits[0]
        assert torch.equal(got, alone[:tokens]), f"{tokens} tokens"


@needs_attention_kernel
@pytest.mark.parametrize("key", ["qwen2", "llama"])
def test_chunked_prefill_equals_one_prefill(models, key) -> None:
    model, prompt = models[key], _prompt(40)
    whole = model(prompt[None], cache=model.new_cache(64)).logits[0]
    cache = model.new_cache(64)
    chunks = [model(prompt[None, start:end], cache=cache).logits[0] for start, end in ((0, 13), (13, 14), (14, 40))]
    assert torch.equal(torch.cat(chunks), whole)


@needs_attention_kernel
def test_tree_nodes_get_the_logits_of_their_path_decoded_alone(models) -> None:
    model, prompt = models["qwen2"], _prompt()
    parents = [-1, 0, 0, 1, 2, 2, 3, 5]
    tokens = _prompt(len(parents)).tolist()
    layout = compile_tree(parents)
    cache = model.new_cache(64)
    model(prompt[None], cache=cache, logits="none")
    n = len(prompt)
    positions = target_positions(layout, n - 1)[None]  # [1, n + 1]: the root is the last prompt token
    mask = tree_attention_mask(layout, n - 1)[None]  # [1, nodes + 1, n + nodes]
    cache.rollback(n - 1)
    root = int(prompt[-1])
    tree_logits = model(torch.tensor([[root, *tokens]]), positions=positions, cache=cache, attn_mask=mask).logits[0]
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        cache.rollback(n)
        alone = _one_at_a_time(model, cache, [tokens[i] for i in reversed(path)])
        assert torch.equal(tree_logits[node + 1], alone[-1]), f"node {node}"


@needs_attention_kernel
def test_ragged_batch_rows_equal_each_row_alone_and_plain_decoding(models) -> None:
    """The server's forward: a prompt chunk, a verification block and a lone token in one padded batch."""
    model = models["llama"]
    c = model.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=64, block_size=4, dtype=model.dtype)
    prompts = [_prompt(n).tolist() for n in (9, 23, 14)]
    tables = [pool.new_table(64) for _ in prompts]
    for table, prompt in zip(tables, prompts):  # prefill each alone
        ragged_forward(model, pool, [RaggedRow(table, prompt, all_logits=False)])
        table.rollback(len(prompt))
    news = [_prompt(5).tolist(), _prompt(1).tolist(), _prompt(3).tolist()]
    rows = [RaggedRow(table, new, all_logits=True) for table, new in zip(tables, news)]
    batched = ragged_forward(model, pool, rows).logits
    for r, (row, prompt) in enumerate(zip(rows, prompts)):
        alone = ragged_forward(model, pool, [row]).logits[0]
        assert torch.equal(batched[r], alone), f"row {r}"
        cache = model.new_cache(64)
        model(torch.tensor([prompt]), cache=cache, logits="none")
        assert torch.equal(alone, _one_at_a_time(model, cache, news[r])), f"row {r} vs the decoder"


@needs_attention_kernel
def test_attention_groups_bound_the_padded_workspace_and_change_no_bit(models) -> None:
    """A long prompt chunk next to short rows: with a small workspace budget the rows attend in several groups,
    each within the budget (unless a row alone exceeds it), and every row's logits and hidden states are bitwise
    those of one padded group."""
    model = models["llama"]
    c = model.config
    pool = PagedKVPool(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=256, block_size=4, dtype=model.dtype)
    prompts = [_prompt(n).tolist() for n in (9, 23, 14, 31, 5)]
    tables = [pool.new_table(96) for _ in prompts]
    for table, prompt in zip(tables, prompts):
        ragged_forward(model, pool, [RaggedRow(table, prompt, all_logits=False)])
        table.rollback(len(prompt))
    news = [_prompt(5).tolist(), _prompt(1).tolist(), _prompt(3).tolist(), _prompt(47).tolist(), _prompt(1).tolist()]
    rows = [RaggedRow(table, new, all_logits=True) for table, new in zip(tables, news)]
    rows.append(RaggedRow(pool.new_table(64), _prompt(40).tolist(), all_logits=False))  # a fresh prompt
    cost = WorkspaceCost.of(model)
    whole = build_layout(rows, model.device, cost, workspace_bytes=2**40)
    assert len(whole.groups) == 1
    budget = whole.workspace_bytes // 4
    split = build_layout(rows, model.device, cost, workspace_bytes=budget)
    assert len(split.groups) >= 3
    for group in split.groups:
        assert group.workspace_bytes <= budget or len(group.query_valid) == 1
    assert sorted(torch.cat([g.flat_index for g in split.groups]).tolist()) == list(range(len(whole.input_ids)))
    one = ragged_forward(model, pool, rows, hidden_layers=(0, 2), workspace_bytes=2**40)
    grouped = ragged_forward(model, pool, rows, hidden_layers=(0, 2), workspace_bytes=budget)
    assert grouped.workspace_bytes < one.workspace_bytes
    for r in range(len(rows)):
        assert torch.equal(grouped.logits[r], one.logits[r]), f"row {r}"
        for layer in (0, 2):
            assert torch.equal(grouped.hidden[r][layer], one.hidden[r][layer]), f"row {r} layer {layer}"


@needs_attention_kernel
@pytest.mark.parametrize("k", range(1, 9))
def test_bf16_speculative_greedy_equals_plain_greedy(models, k, pipeline) -> None:
    target, prompt = models["qwen2"], repetitive_prompt()
    capacity = len(prompt) + NEW_TOKENS + 2 * k + 2
    expected = plain_ids(target, prompt, capacity)
    assert spec_ids(target, ModelDrafter(target, k), prompt, capacity, pipeline=pipeline) == expected
    assert spec_ids(target, RandomDrafter(k), prompt, capacity, pipeline=pipeline) == expected


@needs_attention_kernel
@pytest.mark.parametrize("k", [2, 5])
def test_bf16_ngram_trees_equal_plain_greedy(models, k, pipeline) -> None:
    target, prompt = models["llama"], repetitive_prompt()
    drafter = NgramDrafter(k, num_candidates=3)
    capacity = len(prompt) + NEW_TOKENS + drafter.max_draft_tokens + 1
    stats = DecodeStats()
    assert spec_ids(target, drafter, prompt, capacity, stats=stats, pipeline=pipeline) == plain_ids(target, prompt,
                                                                                                   capacity)


@needs_attention_kernel
@pytest.mark.parametrize("prefill_chunk", [512, 4], ids=["whole-prefill", "chunked-prefill"])
def test_bf16_batched_requests_give_their_plain_tokens(models, prefill_chunk) -> None:
    """The batch engine (ragged forward, paged cache) with drafts of mixed lengths next to three other prompts: each
    request's tokens equal plain decoding of it alone."""
    engine = Engine(models["qwen2"], IdTokenizer(), name="tiny")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8, max_prefill_tokens=prefill_chunk),
                        request_drafters(engine))
    requests = [BatchRequest(p, 16, drafter="ngram", num_draft_tokens=k) for p, k in zip(prompts(4), (3, 0, 8, 5))]
    for request, result in zip(requests, run_to_completion(batch, requests)):
        plain = BatchRequest(request.prompt_ids, request.max_new_tokens, num_draft_tokens=0)
        assert result.token_ids == single(engine, request.prompt_ids, plain)


@needs_attention_kernel
def test_bf16_seeded_sampling_is_the_same_alone_and_in_a_batch(models) -> None:
    engine = Engine(models["qwen2"], IdTokenizer(), name="tiny")
    batch = BatchEngine(engine, BatchConfig(num_blocks=64, block_size=8), request_drafters(engine))
    request = BatchRequest(prompts(1)[0], 12, params=SamplingParams(temperature=0.8, seed=7), drafter="ngram",
                           num_draft_tokens=3)
    others = [BatchRequest(p, 12, params=SamplingParams(temperature=1.0)) for p in prompts(3, seed=1)]
    alone = run_to_completion(batch, [request])[0].token_ids
    assert run_to_completion(batch, others[:2] + [request] + others[2:])[2].token_ids == alone
