"""QuantLinear (int8 weight-only, per-output-channel scale): quantization, panel layout, the AVX2 kernel
against its PyTorch fallback and the dequantized reference, and row-count invariance of the kernel."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels.quant_linear import (
    QuantLinear,
    pack_int8,
    quant_kernel_status,
    quant_kernels_available,
    quantize_int8,
    unpack_int8,
)

ROWS = (1, 2, 3, 7, 8, 9, 16, 17, 64)
OUT = (8, 24, 100)
IN = (16, 40, 1536)

needs_kernel = pytest.mark.skipif(not quant_kernels_available(), reason=f"int8 kernel unavailable: {quant_kernel_status()}")


def _backends() -> list[str]:
    return ["avx2", "torch"] if quant_kernels_available() else ["torch"]


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5  # [N, K]
    w[:, 0] *= 8  # one outlier column: scales differ from row to row
    return w, torch.randn(n, generator=g)


def _tolerance(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    # fp32 sums in another order: bounded by |x| @ |Q|^T * scale times a few ulps (K terms).
    bound = (F.linear(x.abs(), q.float().abs()) * scale).amax().item()
    return 4e-7 * x.shape[1] ** 0.5 * bound + 1e-6


def _dequantized_reference(x, q, scale, bias):
    return F.linear(x.double(), q.double() * scale.double()[:, None], None if bias is None else bias.double())


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


def test_pack_layout_and_round_trip() -> None:
    q = torch.randint(-127, 128, (37, 5), dtype=torch.int8)
    packed = pack_int8(q)
    assert packed.shape == (3, 5, 16)
    for p, k, j in itertools.product(range(3), range(5), range(16)):
        expected = q[16 * p + j, k] if 16 * p + j < 37 else 0
        assert packed[p, k, j] == expected
    assert torch.equal(unpack_int8(packed, 37), q)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("n,k", list(itertools.product(OUT, IN)))
def test_matches_dequantized_reference(backend: str, n: int, k: int) -> None:
    w, b = _weights(n, k, seed=n * 7919 + k)
    for bias in (None, b):
        layer = QuantLinear.from_weight(w, bias, backend=backend)
        q, scale = quantize_int8(w)
        assert torch.equal(layer.int8_weight(), q) and torch.equal(layer.scale_data, scale)
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            with torch.inference_mode():
                got = layer(x)
            ref = _dequantized_reference(x, q, scale, bias).float()
            torch.testing.assert_close(got, ref, rtol=0, atol=_tolerance(x, q, scale))


@needs_kernel
def test_kernel_matches_fallback_and_tolerance_catches_a_wrong_scale_or_layout() -> None:
    n, k = 100, 1536
    w, b = _weights(n, k, seed=1)
    kernel = QuantLinear.from_weight(w, b, backend="avx2")
    fallback = QuantLinear.from_weight(w, b, backend="torch")
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_int8(w)
    atol = _tolerance(x, q, scale)
    with torch.inference_mode():
        got, ref = kernel(x), fallback(x)
        torch.testing.assert_close(got, ref, rtol=0, atol=atol)
        wrong_scale = QuantLinear(kernel.weight_data, scale.roll(1), kernel.bias_data, k, n, "avx2")(x)
        wrong_layout = QuantLinear(pack_int8(q.roll(1, dims=1)), scale, kernel.bias_data, k, n, "avx2")(x)
    assert (wrong_scale - ref).abs().max() > 100 * atol
    assert (wrong_layout - ref).abs().max() > 100 * atol


@needs_kernel
@pytest.mark.parametrize("n,k", [(100, 1536), (33, 40), (48, 300)])
def test_kernel_is_row_count_invariant(n: int, k: int) -> None:
    """Row r of the output is bitwise the same whatever the number of rows in the call (verification of a
    draft block computes exactly what plain decoding computes)."""
    w, b = _weights(n, k, seed=3)
    layer = QuantLinear.from_weight(w, b, backend="avx2")
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = layer(x)
        for m in range(1, 20):
            assert torch.equal(layer(x[:m]), full[:m]), m
        for r in (0, 5, 17):
            assert torch.equal(layer(x[r : r + 1]), full[r : r + 1]), r


@needs_kernel
def test_thread_count_does_not_change_results() -> None:
    w, b = _weights(300, 1536, seed=5)
    layer = QuantLinear.from_weight(w, b, backend="avx2")
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


@pytest.mark.parametrize("backend", _backends())
def test_dtypes_and_shapes(backend: str) -> None:
    w, b = _weights(24, 40, seed=7)
    layer = QuantLinear.from_weight(w.to(torch.bfloat16), b, backend=backend)
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    with torch.inference_mode():
        y = layer(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.bfloat16
    assert layer.state_dict() == {}
    torch.testing.assert_close(layer.dequantized_weight(), w.to(torch.bfloat16).float(), rtol=0, atol=0.06)
    with pytest.raises(ValueError, match="expected last dim 40"):
        layer(torch.randn(3, 41))


def test_env_var_forces_fallback_with_one_warning() -> None:
    code = (
        "import warnings, torch\n"
        "with warnings.catch_warnings(record=True) as ws:\n"
        "    warnings.simplefilter('always')\n"
        "    from dflash2.kernels.quant_linear import QuantLinear, quant_kernel_status\n"
        "    layer = QuantLinear.from_weight(torch.randn(3, 8)); QuantLinear.from_weight(torch.randn(3, 8))\n"
        "print(layer.backend, sum('int8' in str(w.message) for w in ws), quant_kernel_status())\n"
    )
    env = dict(os.environ, DFLASH2_KERNELS="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert out.startswith("torch 1 disabled by DFLASH2_KERNELS=off"), out
