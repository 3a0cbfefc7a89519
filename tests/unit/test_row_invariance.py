"""The row-count audit of docs/attention.md: every op a decoder row goes through gives bitwise the same result for a
row whatever the number of rows computed with it (1..17, as in decoding, verification and tree verification), in
bf16 and fp32, on 1 and 2 threads, at the sizes of Qwen2.5-Coder-1.5B. Attention itself: test_attention_invariant.py;
the whole decoder and the server's ragged forward: test_decoder_row_invariance.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels import PackedLinear, kernel_status, kernels_available
from dflash2.kernels.layer_ops import rotate_half
from dflash2.models.decoder import RMSNorm
from dflash2.verify.sampling import SamplingParams, logits_to_probs

ROWS = range(1, 18)
DTYPES = [torch.bfloat16, torch.float32]
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm(dtype, threads) -> None:
    norm = RMSNorm(HIDDEN, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(HIDDEN, dtype=dtype, seed=1))
        assert_rows_invariant(norm, _randn(1, 17, HIDDEN, dtype=dtype) * 3)


@pytest.mark.parametrize("dtype", DTYPES)
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_and_swiglu_on_split_views(dtype, threads) -> None:
    gate_up = _randn(1, 17, 2 * INTERMEDIATE, dtype=dtype) * 2  # the fused projection's output, split as views

    def swiglu(x):
        gate, up = x.split(INTERMEDIATE, dim=-1)
        return F.silu(gate) * up

    assert_rows_invariant(swiglu, gate_up)
    other = _randn(1, 17, HIDDEN, dtype=dtype, seed=2)
    assert_rows_invariant(torch.add, _randn(1, 17, HIDDEN, dtype=dtype), other)


@pytest.mark.skipif(not kernels_available(), reason=f"packed kernel unavailable: {kernel_status()}")
@pytest.mark.parametrize("dtype", DTYPES)
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
