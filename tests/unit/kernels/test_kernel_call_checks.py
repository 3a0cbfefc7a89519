"""The layer ops, the attention kernel and the packed bf16 layer check what they hand to C++: a wrong dtype, device,
layout or size, or sizes that disagree between arguments, is one ValueError naming the kernel and the argument
(never a read past a tensor or a crash: a zero head count or width divides by zero on the C++ side), and valid calls
still give the reference's results."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels import attention, layer_ops
from dflash2.kernels import packed_linear as pl
from dflash2.kernels.boundary import KernelInputError

needs_layer_ops = pytest.mark.skipif(not layer_ops.layer_ops_available(),
                                     reason=f"layer ops kernel unavailable: {layer_ops.layer_ops_status()}")
needs_attention = pytest.mark.skipif(not attention.attention_kernel_available(),
                                     reason=f"attention kernel unavailable: {attention.attention_kernel_status()}")


def _refused(call, kernel: str, argument: str) -> None:
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert isinstance(error.value, KernelInputError) and "\n" not in message, message
    assert message.startswith(f"{kernel}: ") and argument in message, message


def _randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@needs_layer_ops
def test_rms_norm_boundary():
    x, w = _randn(3, 64, dtype=torch.bfloat16), _randn(64, dtype=torch.bfloat16, seed=1)
    run = layer_ops.rms_norm
    _refused(lambda: run(x.half(), w.half(), 1e-6), "rms_norm", "x")  # dtype the kernel has no code for
    _refused(lambda: run(x.to(torch.int32), w, 1e-6), "rms_norm", "x")
    _refused(lambda: run(x, w.float(), 1e-6), "rms_norm", "weight")  # dtypes that disagree
    _refused(lambda: run(x.to("meta"), w, 1e-6), "rms_norm", "x")  # not on the CPU
    _refused(lambda: run(x[0, 0], w, 1e-6), "rms_norm", "x")  # 0-d
    _refused(lambda: run(x[:, :60], w[:60], 1e-6), "rms_norm", "x")  # D not a multiple of 8
    _refused(lambda: run(x[:, :0], w[:0], 1e-6), "rms_norm", "x")  # D = 0
    _refused(lambda: run(x, w[:56], 1e-6), "rms_norm", "weight")  # sizes that disagree
    _refused(lambda: run(x, w.view(8, 8), 1e-6), "rms_norm", "weight")  # the right count, not [D]
    _refused(lambda: run(x, torch.cat([w, w]), 1e-6), "rms_norm", "weight")
    # any strides: the kernel reads a contiguous copy; the same result as the contiguous input
    strided = torch.cat([x, x], 1)[:, ::2]
    assert not strided.is_contiguous()
    assert torch.equal(run(strided, w[::1], 1e-6), run(strided.contiguous(), w, 1e-6))
    assert torch.equal(run(x, torch.stack([w, w], 1)[:, 0], 1e-6), run(x, w, 1e-6))
    expected = layer_ops.reference_rms_norm(x, w, 1e-6)
    assert torch.allclose(run(x, w, 1e-6).float(), expected.float(), rtol=1e-2, atol=1e-2)


@needs_layer_ops
def test_qkv_rope_boundary():
    heads, kv_heads, dh = 4, 2, 16
    qkv = _randn(2, 3, (heads + 2 * kv_heads) * dh)
    angles = _randn(1, 1, 3, dh, seed=1)
    cos, sin = angles.cos(), angles.sin()
    run = layer_ops.qkv_rope
    _refused(lambda: run(qkv.half(), cos.half(), sin.half(), heads, kv_heads), "qkv_rope", "qkv")
    _refused(lambda: run(qkv.double(), cos, sin, heads, kv_heads), "qkv_rope", "qkv")
    _refused(lambda: run(qkv, cos.bfloat16(), sin, heads, kv_heads), "qkv_rope", "cos")
    _refused(lambda: run(qkv, cos, sin.bfloat16(), heads, kv_heads), "qkv_rope", "sin")
    _refused(lambda: run(qkv.to("meta"), cos, sin, heads, kv_heads), "qkv_rope", "qkv")
    _refused(lambda: run(qkv, cos, sin.to("meta"), heads, kv_heads), "qkv_rope", "sin")
    _refused(lambda: run(qkv[0], cos, sin, heads, kv_heads), "qkv_rope", "qkv")  # 2-D
    _refused(lambda: run(qkv, cos[0], sin[0], heads, kv_heads), "qkv_rope", "cos")  # 3-D
    _refused(lambda: run(qkv, cos, sin[..., :8], heads, kv_heads), "qkv_rope", "sin")  # shapes that disagree
    _refused(lambda: run(qkv[:, :2], cos, sin, heads, kv_heads), "qkv_rope", "cos")  # T
    _refused(lambda: run(qkv, cos.expand(3, 1, 3, dh), sin.expand(3, 1, 3, dh), heads, kv_heads), "qkv_rope", "cos")
    _refused(lambda: run(qkv, cos.transpose(1, 2), sin.transpose(1, 2), heads, kv_heads), "qkv_rope", "cos")
    _refused(lambda: run(qkv, cos[..., :15], sin[..., :15], heads, kv_heads), "qkv_rope", "cos")  # odd Dh
    _refused(lambda: run(qkv[..., :0], cos[..., :0], sin[..., :0], 0, 0), "qkv_rope", "cos")  # Dh = 0
    _refused(lambda: run(qkv[..., :0], cos, sin, 0, 0), "qkv_rope", "heads")  # no heads at all
    _refused(lambda: run(qkv, cos, sin, heads, kv_heads + 1), "qkv_rope", "heads")  # W is not (H + 2 Hkv) Dh
    _refused(lambda: run(qkv, cos, sin, 8, 0), "qkv_rope", "kv_heads")
    _refused(lambda: run(qkv, cos, sin, -2, 5), "qkv_rope", "heads")
    # valid calls, strided ones among them (read through contiguous copies), are the reference bit for bit
    strided = qkv.transpose(0, 1).contiguous().transpose(0, 1)
    for args in ((qkv, cos, sin), (strided, cos, sin), (qkv, cos.expand(2, 1, 3, dh), sin.expand(2, 1, 3, dh))):
        got, expected = run(*args, heads, kv_heads), layer_ops.reference_qkv_rope(*args, heads, kv_heads)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


@needs_layer_ops
def test_silu_mul_boundary():
    gate_up = _randn(3, 2, 64) * 4
    run = layer_ops.silu_mul
    _refused(lambda: run(gate_up.half()), "silu_mul", "gate_up")
    _refused(lambda: run(gate_up.to("meta")), "silu_mul", "gate_up")
    _refused(lambda: run(gate_up[0, 0, 0]), "silu_mul", "gate_up")  # 0-d
    _refused(lambda: run(gate_up[..., :40]), "silu_mul", "gate_up")  # I not a multiple of 8
    _refused(lambda: run(gate_up, lanes=4), "silu_mul", "lanes")
    strided = gate_up.transpose(0, 1)
    assert torch.equal(run(strided), run(strided.contiguous()))
    assert torch.allclose(run(gate_up), layer_ops.reference_silu_mul(gate_up), rtol=1e-5, atol=1e-5)


def _attention_inputs(dtype=torch.float32, batch=2, heads=4, kv_heads=2, tokens=3, slots=11, dh=16):
    q = _randn(batch, heads, tokens, dh, dtype=dtype)
    k = _randn(batch, kv_heads, slots, dh, dtype=dtype, seed=1)
    v = _randn(batch, kv_heads, slots, dh, dtype=dtype, seed=2)
    mask = torch.rand(batch, 1, tokens, slots, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True
    return q, k, v, mask


def _sdpa(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1),
                                          v.float().repeat_interleave(group, 1), attn_mask=mask)


@needs_attention
def test_attention_boundary():
    q, k, v, mask = _attention_inputs()
    run = attention.invariant_attention
    _refused(lambda: run(q.double(), k.double(), v.double(), mask), "attention", "q")
    _refused(lambda: run(q, k.bfloat16(), v, mask), "attention", "k")
    _refused(lambda: run(q, k, v.half(), mask), "attention", "v")
    _refused(lambda: run(q, k, v, mask.float()), "attention", "attn_mask")
    _refused(lambda: run(q.to("meta"), k, v, mask), "attention", "q")
    _refused(lambda: run(q, k, v.to("meta"), mask), "attention", "v")
    _refused(lambda: run(q, k, v, mask.to("meta")), "attention", "attn_mask")
    _refused(lambda: run(q[0], k, v, mask), "attention", "q")  # 3-D
    _refused(lambda: run(q, k[0], v[0], mask), "attention", "k")
    _refused(lambda: run(q, k, v, mask[:, 0]), "attention", "attn_mask")
    _refused(lambda: run(q[..., :12], k[..., :12], v[..., :12], mask), "attention", "q")  # Dh not a multiple of 8
    _refused(lambda: run(q[..., :0], k[..., :0], v[..., :0], mask), "attention", "q")  # Dh = 0
    _refused(lambda: run(q, k[:, :0], v[:, :0], mask), "attention", "k")  # no kv heads (divides by zero in C++)
    _refused(lambda: run(q, k[:1], v[:1], mask), "attention", "k")  # batch
    _refused(lambda: run(q[:, :3], k, v, mask), "attention", "k")  # 2 kv heads do not divide 3 heads
    _refused(lambda: run(q, k[..., :8], v[..., :8], mask), "attention", "k")  # head dims that disagree
    _refused(lambda: run(q, k, v[:, :, :10], mask), "attention", "v")  # slots that disagree
    _refused(lambda: run(q, k, v[:, :1], mask), "attention", "v")
    _refused(lambda: run(q, k, v, mask[..., :10]), "attention", "attn_mask")
    _refused(lambda: run(q, k, v, mask[:, :, :2]), "attention", "attn_mask")
    _refused(lambda: run(q, k, v, torch.cat([mask, mask], 1)), "attention", "attn_mask")
    _refused(lambda: run(q, k, v, torch.cat([mask, mask, mask], 0)), "attention", "attn_mask")


@needs_attention
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_valid_calls_match_sdpa(dtype):
    """Broadcast masks, strided q / k / v (a cache's views, a last dimension with a stride) and GQA still pass."""
    q, k, v, mask = _attention_inputs(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    cache = torch.cat([k, v], 2)  # k and v as views of one cache: strided along the slots
    strided_q = torch.stack([q, q], -1)[..., 0]  # last dimension of stride 2: made contiguous by the wrapper
    cases = [(q, k, v, mask), (q, k, v, mask[:1]), (q, k, v, mask[:, :, :1]), (q, k, v, None),
             (q, cache[:, :, :11], cache[:, :, 11:], mask), (strided_q, k, v, mask)]
    for case in cases:
        got = attention.invariant_attention(*case)
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.allclose(got.float(), _sdpa(*case), rtol=tolerance, atol=tolerance)
    assert math.isfinite(attention.invariant_attention(q, k, v, None, True).float().sum().item())


@pytest.mark.skipif(not pl.kernels_available(), reason="packed kernel unavailable")
def test_packed_bf16_panels_fit_their_layout():
    w, b = _randn(40, 72), _randn(40, seed=1)
    layer = pl.PackedLinear.from_weight(w, b, backend=pl.KERNEL)
    packed, bias = layer.weight_data, layer.bias_data
    x = _randn(5, 72, seed=2)
    assert torch.allclose(layer(x), F.linear(x, w.bfloat16().float(), b), rtol=1e-4, atol=1e-4)
    damaged = [
        ("weight", packed.float(), bias),  # dtype
        ("weight", packed.transpose(0, 1).contiguous().transpose(0, 1), bias),  # not contiguous
        ("weight", packed[:, :64].contiguous(), bias),  # K that disagrees with in_features
        ("weight", packed[:2].contiguous(), bias),  # too few panels for 40 outputs
        ("weight", packed.reshape(3, 36, 32), bias),  # the layout's element count in another shape
        ("bias", packed, bias[:39].contiguous()),
        ("bias", packed, bias.double()),
    ]
    for argument, weight, bad_bias in damaged:
        with pytest.raises(ValueError) as error:
            pl.PackedLinear(weight, bad_bias, 72, 40, pl.KERNEL)
        assert isinstance(error.value, KernelInputError) and f": {argument} " in str(error.value), str(error.value)


def test_packed_bf16_tile_layout_is_checked():
    """The tile layout (AMX, AVX512-BF16) has a check of its own, run here without those CPUs."""
    from dflash2.kernels import amx
    from dflash2.kernels.boundary import check_packed_bf16

    tiles = amx.pack_weight_amx(_randn(40, 72))  # [3, 3, 16, 32]
    check_packed_bf16(True, tiles, None, 72, 40)
    for bad, k, n in ((tiles, 100, 40), (tiles, 72, 50), (tiles[:, :2].contiguous(), 72, 40),
                      (tiles.float(), 72, 40), (tiles.transpose(2, 3), 72, 40)):
        with pytest.raises(KernelInputError, match="weight"):
            check_packed_bf16(True, bad, None, k, n, "layers.0.attn.wqkv")
