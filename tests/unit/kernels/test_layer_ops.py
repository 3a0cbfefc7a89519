"""The one-call layer kernels (dflash2.kernels.layer_ops): the rotary embedding bit for bit PyTorch's operations,
RMSNorm and SiLU(gate) * up close to them and row invariant; the decoder uses them only where no gradient is wanted, and a whole model
gives the same greedy tokens with them as without."""

from __future__ import annotations

import pytest
import torch

from dflash2.kernels import layer_ops
from dflash2.models.decoder import RMSNorm
from dflash2.models.loading import load_transformer
from dflash2.platform import cpu, reload_settings

pytestmark = pytest.mark.skipif(not layer_ops.layer_ops_available(),
                                reason=f"layer ops kernel unavailable: {layer_ops.layer_ops_status()}")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch,shared,head_dim", [(1, True, 128), (3, False, 64), (2, True, 24)])
def test_qkv_rope_is_bitwise_the_pytorch_operations(dtype, batch, shared, head_dim):
    """Head dims with and without a vector tail (24: 12 per half); cos / sin per batch row or shared."""
    g = torch.Generator().manual_seed(head_dim)
    qkv = (torch.randn(batch, 7, (12 + 2 * 2) * head_dim, generator=g) * 4).to(dtype)
    angles = torch.randn(1 if shared else batch, 1, 7, head_dim, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = layer_ops.qkv_rope(qkv, cos, sin, 12, 2)
    expected = layer_ops.reference_qkv_rope(qkv, cos, sin, 12, 2)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b)
    strided = qkv.transpose(0, 1).contiguous().transpose(0, 1)  # not contiguous: read as it is
    assert all(torch.equal(a, b) for a, b in zip(layer_ops.qkv_rope(strided, cos, sin, 12, 2), got))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_is_close_to_pytorch_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 9, 1536, generator=g) * 5).to(dtype)
    weight = torch.randn(1536, generator=g).to(dtype)
    got = layer_ops.rms_norm(x, weight, 1e-6)
    expected = layer_ops.reference_rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 8e-3  # the sum of squares in another order: a last bit
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
    for row in (0, 5, 8):  # a row of an 18-row call is bitwise the row alone
        assert torch.equal(layer_ops.rms_norm(x[1, row : row + 1], weight, 1e-6), got[1, row : row + 1])
    assert torch.equal(layer_ops.rms_norm(x[:, 2:5], weight, 1e-6), got[:, 2:5])  # a strided view


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_mul_is_close_to_pytorch_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(2, 9, 2 * 8960, generator=g) * 4).to(dtype)
    gate_up[0, 0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.25, -87.75])  # the exp's edges
    got = layer_ops.silu_mul(gate_up)
    expected = layer_ops.reference_silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == (2, 9, 8960)
    if dtype == torch.float32:  # an exp of its own: within a few ulp of PyTorch's
        torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-30)
    else:  # the same bits but where silu's fp32 value lies within a few ulp of a bf16 rounding boundary
        differ = (got != expected).float().mean().item()
        assert differ < 1e-3, differ
        torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-30)
    for row in (0, 5, 8):  # a row of an 18-row call is bitwise the row alone
        assert torch.equal(layer_ops.silu_mul(gate_up[1, row : row + 1]), got[1, row : row + 1])
    assert torch.equal(layer_ops.silu_mul(gate_up[:, 2:5]), got[:, 2:5])  # a strided view
    assert torch.isnan(layer_ops.silu_mul(torch.full((1, 16), float("nan"), dtype=dtype))).all()
    assert torch.equal(layer_ops.silu_mul(gate_up, lanes=8), got)  # AVX2 lanes: the same bits as the default
    if not cpu().missing(("avx512f", "avx512bw")):  # 16 lanes, and 16 + a last 8 (I = 24)
        assert torch.equal(layer_ops.silu_mul(gate_up, lanes=16), got)
        odd = gate_up[..., 8920:8968]
        assert torch.equal(layer_ops.silu_mul(odd, lanes=16), layer_ops.silu_mul(odd, lanes=8))


def test_the_decoder_keeps_pytorch_where_a_gradient_is_wanted_or_the_switch_is_off(monkeypatch):
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(3, 64, requires_grad=True)
    norm(x).sum().backward()  # the kernel has no backward: the PyTorch path ran
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert layer_ops.use_layer_ops(x, norm.weight)  # no gradient recorded: the kernel may run
    frozen = torch.randn(3, 64)
    assert not layer_ops.use_layer_ops(frozen, norm.weight)  # the weight is trained: keep autograd
    with torch.inference_mode():
        assert layer_ops.use_layer_ops(frozen, norm.weight)
        monkeypatch.setenv(layer_ops.ENV, "torch")
        reload_settings()
        assert not layer_ops.use_layer_ops(frozen, norm.weight)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_model_decodes_the_same_tokens_with_and_without_the_kernels(tiny_model_dirs, monkeypatch, dtype):
    model = load_transformer(tiny_model_dirs["qwen2"], dtype)
    prompt = torch.randint(0, 256, (1, 21), generator=torch.Generator().manual_seed(3))

    def greedy(switch: str) -> tuple[list[int], torch.Tensor]:
        monkeypatch.setenv(layer_ops.ENV, switch)
        reload_settings()
        cache, ids, first = model.new_cache(64), prompt, None
        tokens = []
        with torch.inference_mode():
            for _ in range(12):
                logits = model(ids, cache=cache, logits="last").logits[0, -1]
                first = logits if first is None else first
                tokens.append(int(logits.argmax()))
                ids = torch.tensor([[tokens[-1]]])
        return tokens, first

    with_kernels, logits = greedy("on")
    without, expected = greedy("torch")
    assert with_kernels == without
    torch.testing.assert_close(logits, expected, rtol=2e-2, atol=2e-2)


def test_rope_tables_are_the_correctly_rounded_values_whatever_the_call():
    # cos / sin from fp64 rounded to fp32: the same bits for a position in any call (PyTorch's fp32 cosine gave
    # different last bits from one process to the next), within an ulp of the fp32 functions (Hugging Face's path)
    from dflash2.models.decoder import rope_tables

    inv_freq = 1.0 / (1000000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128)).float()
    positions = torch.arange(0, 4096)[None]
    cos, sin = rope_tables(positions, inv_freq, torch.float32)
    angles = (positions.float()[..., None] * inv_freq).repeat(1, 1, 2)[:, None]
    assert torch.equal(cos, angles.double().cos().float()) and torch.equal(sin, angles.double().sin().float())
    assert (cos - angles.cos()).abs().max() <= 2 ** -23 and (sin - angles.sin()).abs().max() <= 2 ** -23
    for start, stop in ((0, 41), (40, 41), (7, 300), (4000, 4096)):  # a slice of positions: the same rows
        part_cos, part_sin = rope_tables(positions[:, start:stop], inv_freq, torch.bfloat16)
        assert torch.equal(part_cos, cos[:, :, start:stop].bfloat16())
        assert torch.equal(part_sin, sin[:, :, start:stop].bfloat16())


def test_the_decoder_entry_points_take_the_kernel_where_it_fits_and_pytorch_elsewhere(monkeypatch):
    """run_*: one check decides; arguments the kernel does not take go to the PyTorch operations (no error), the
    ones it takes go to the kernel (seen by counting its calls)."""
    calls = []
    ops = layer_ops._state["op"]
    counted = tuple((lambda op: (lambda *a: calls.append(1) or op(*a)))(op) for op in ops)
    monkeypatch.setitem(layer_ops._state, "op", counted)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 12, generator=g)  # D = 12: not a multiple of 8
    weight = torch.randn(12, generator=g)
    assert torch.equal(layer_ops.run_rms_norm(x, weight, 1e-6), layer_ops.reference_rms_norm(x, weight, 1e-6))
    assert torch.equal(layer_ops.run_rms_norm(x[:, :8].contiguous(), weight[:8].double(), 1e-6),
                       layer_ops.reference_rms_norm(x[:, :8].contiguous(), weight[:8].double(), 1e-6))
    gate_up = torch.randn(2, 24, generator=g)  # 2I = 24: I = 12
    assert torch.equal(layer_ops.run_silu_mul(gate_up), layer_ops.reference_silu_mul(gate_up))
    assert calls == []
    layer_ops.run_rms_norm(torch.randn(2, 16, generator=g), torch.randn(16, generator=g), 1e-6)
    layer_ops.run_silu_mul(torch.randn(2, 32, generator=g))
    assert len(calls) == 2
