"""QuantLinear (int8 per-output-channel and int4 grouped weight-only formats): quantization, panel layouts, the
AVX2 kernels against their PyTorch fallback and the dequantized reference, and row-count invariance."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels.quant_linear import (
    QUANT_FORMATS,
    QuantLinear,
    pack_int4,
    pack_int8,
    quant_kernel_status,
    quant_kernels_available,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int8,
)
from tests.unit.kernels.test_packed_linear import assert_row_count_invariant

ROWS = (1, 2, 3, 7, 8, 9, 16, 17, 64)
OUT = (8, 24, 100)
IN = (32, 96, 1536)  # int4 groups are 32 inputs

needs_kernel = pytest.mark.skipif(not quant_kernels_available(), reason=f"int8 kernel unavailable: {quant_kernel_status()}")


def _backends() -> list[str]:
    return ["avx2", "torch"] if quant_kernels_available() else ["torch"]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5  # [N, K]
    w[:, 0] *= 8  # one outlier column: scales differ from row to row
    return w, torch.randn(n, generator=g)


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float(Q) * scale, fp32 [N, K], rounded once as the layers do (int8: per row, int4: per group of 32)."""
    return q.float() * (scale[:, None] if scale.dim() == 1 else scale.repeat_interleave(32, dim=1))


def _tolerance(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    # fp32 sums in another order: bounded by |x| @ |W|^T times a few ulps (K terms).
    bound = F.linear(x.abs(), _dequantized(q, scale).abs()).amax().item()
    return 4e-7 * x.shape[1] ** 0.5 * bound + 1e-6


def _dequantized_reference(x, q, scale, bias):
    return F.linear(x.double(), _dequantized(q, scale).double(), None if bias is None else bias.double())


QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4}


def test_quantize_int8_is_symmetric_per_channel() -> None:
    w, _ = _weights(40, 70, seed=0)
    w[3] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.shape == w.shape
    assert torch.equal(scale, w.abs().amax(dim=1) / 127)
    assert q.abs().max() == 127 and torch.equal(q[3], torch.zeros(70, dtype=torch.int8))
    nonzero = torch.arange(40) != 3
    err = (q.float() * scale[:, None] - w).abs()[nonzero]  # rounding to the nearest step
    assert (err <= scale[nonzero, None] / 2 * (1 + 1e-5)).all()


def test_quantize_int4_is_symmetric_per_group_of_32() -> None:
    w, _ = _weights(20, 96, seed=0)
    w[2, 32:64] = 0.0
    q, scales = quantize_int4(w)
    assert q.dtype == torch.int8 and scales.shape == (20, 3) and q.abs().max() == 7
    assert torch.equal(scales, w.view(20, 3, 32).abs().amax(dim=2) / 7)
    assert scales[2, 1] == 0 and (q[2, 32:64] == 0).all()
    step = scales.repeat_interleave(32, dim=1)
    assert ((_dequantized(q, scales) - w).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4(torch.randn(4, 40))


def test_int4_pack_layout_and_round_trip() -> None:
    q = torch.randint(-8, 8, (37, 64), dtype=torch.int8)
    scales = torch.rand(37, 2)
    packed, packed_scales = pack_int4(q, scales)
    assert packed.shape == (3, 32, 16) and packed.dtype == torch.uint8 and packed_scales.shape == (3, 2, 16)
    for p, i, j in itertools.product(range(3), range(32), range(16)):
        n = 16 * p + j
        expected = (int(q[n, 2 * i]) + 8) | (int(q[n, 2 * i + 1]) + 8) << 4 if n < 37 else 8 | 8 << 4
        assert packed[p, i, j] == expected
    assert packed_scales[1, 1, 3] == scales[19, 1] and packed_scales[2, 0, 9] == 0
    q2, s2 = unpack_int4(packed, packed_scales, 37)
    assert torch.equal(q2, q) and torch.equal(s2, scales)


def test_pack_layout_and_round_trip() -> None:
    q = torch.randint(-127, 128, (37, 5), dtype=torch.int8)
    packed = pack_int8(q)
    assert packed.shape == (3, 5, 16)
    for p, k, j in itertools.product(range(3), range(5), range(16)):
        expected = q[16 * p + j, k] if 16 * p + j < 37 else 0
        assert packed[p, k, j] == expected
    assert torch.equal(unpack_int8(packed, 37), q)


@pytest.mark.parametrize("weights", QUANT_FORMATS)
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("n,k", list(itertools.product(OUT, IN)))
def test_matches_dequantized_reference(weights: str, backend: str, n: int, k: int) -> None:
    w, b = _weights(n, k, seed=n * 7919 + k)
    for bias in (None, b):
        layer = QuantLinear.from_weight(w, bias, weights=weights, backend=backend)
        q, scale = QUANTIZE[weights](w)
        assert all(torch.equal(a, e) for a, e in zip(layer.quantized(), (q, scale)))
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            with torch.inference_mode():
                got = layer(x)
            ref = _dequantized_reference(x, q, scale, bias).float()
            torch.testing.assert_close(got, ref, rtol=0, atol=_tolerance(x, q, scale))


@needs_kernel
@pytest.mark.parametrize("m", [1, 9])
def test_kernel_matches_fallback_and_tolerance_catches_a_wrong_scale_or_layout(m: int) -> None:
    n, k = 100, 1536
    w, b = _weights(n, k, seed=1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2))
    for weights in QUANT_FORMATS:
        kernel = QuantLinear.from_weight(w, b, weights=weights, backend="avx2")
        fallback = QuantLinear.from_weight(w, b, weights=weights, backend="torch")
        q, scale = QUANTIZE[weights](w)
        atol = _tolerance(x, q, scale)
        wrong_scale = scale.roll(1, dims=0)  # scales of the neighbouring output
        if weights == "int8":
            wrong_layout = pack_int8(q.roll(1, dims=1)), scale
            wrong_scale = pack_int8(q), wrong_scale
        else:
            wrong_layout = pack_int4(q.roll(1, dims=1), scale)
            wrong_scale = pack_int4(q, wrong_scale)
        with torch.inference_mode():
            got, ref = kernel(x), fallback(x)
            torch.testing.assert_close(got, ref, rtol=0, atol=atol)
            for bad in (wrong_scale, wrong_layout):
                y = QuantLinear(weights, *bad, kernel.bias_data, k, n, "avx2")(x)
                assert (y - ref).abs().max() > 100 * atol


@needs_kernel
@pytest.mark.parametrize("weights", QUANT_FORMATS)
@pytest.mark.parametrize("n,k", [(100, 1536), (33, 32), (48, 320)])
def test_kernel_is_row_count_invariant(weights: str, n: int, k: int) -> None:
    """Row r of the output is bitwise the same whatever the number of rows in the call (verification of a
    draft block computes exactly what plain decoding computes)."""
    w, b = _weights(n, k, seed=3)
    assert_row_count_invariant(QuantLinear.from_weight(w, b, weights=weights, backend="avx2"), k)


@needs_kernel
@pytest.mark.parametrize("weights", QUANT_FORMATS)
def test_thread_count_does_not_change_results(weights: str) -> None:
    w, b = _weights(300, 1536, seed=5)
    layer = QuantLinear.from_weight(w, b, weights=weights, backend="avx2")
    x = torch.randn(16, 1536, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        many = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("weights,atol", [("int8", 0.06), ("int4", 0.6)])
@pytest.mark.parametrize("backend", _backends())
def test_dtypes_and_shapes(weights: str, atol: float, backend: str) -> None:
    w, b = _weights(24, 64, seed=7)
    layer = QuantLinear.from_weight(w.to(torch.bfloat16), b, weights=weights, backend=backend)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert layer.state_dict() == {}
    torch.testing.assert_close(layer.dequantized_weight(), w.to(torch.bfloat16).float(), rtol=0, atol=atol)
    with pytest.raises(ValueError, match="expected last dim 64"):
        layer(torch.randn(3, 65))
    with pytest.raises(ValueError, match="unknown quantized format 'int3'"):
        QuantLinear.from_weight(w, weights="int3")


def test_env_var_forces_fallback_with_one_warning() -> None:
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as ws:\n"
        "    warnings.simplefilter('always')\n"
        "    from dflash2.kernels.quant_linear import QuantLinear, quant_kernel_status\n"
        "    layer = QuantLinear.from_weight(torch.randn(3, 8)); QuantLinear.from_weight(torch.randn(3, 8))\n"
        "print(layer.backend, sum('int8/int4' in str(w.message) for w in ws), quant_kernel_status())\n"
    )
    env = dict(os.environ, DFLASH2_KERNELS="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.startswith("torch 1 disabled by DFLASH2_KERNELS=off"), out
