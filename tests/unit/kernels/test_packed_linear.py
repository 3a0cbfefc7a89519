"""PackedLinear (dflash2.kernels): the AMX kernel (where the CPU has it), the AVX2/FMA kernel and the PyTorch
fallback all match F.linear(x.float(), W_bf16.float(), bias) to fp32 accuracy, for any thread count."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash2.kernels import PackedLinear, kernel_status, kernels_available, pack_weight, unpack_weight

ROWS = (1, 2, 3, 7, 8, 9, 16, 17, 64, 300)
OUT = (8, 24, 100)
IN = (16, 40, 1536)

needs_kernel = pytest.mark.skipif(
    not kernels_available(), reason=f"AVX2 kernel unavailable: {kernel_status()}"
)


def _reference(x: torch.Tensor, w_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w_bf16.float(), None if bias is None else bias.float())


def _assert_close(
    got: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol: float = 1e-4
) -> None:
    # Tolerance scaled to the magnitudes summed: |x| @ |W|^T bounds every partial sum.
    scale = F.linear(x.float().abs(), w.float().abs()).amax().item() + 1.0
    torch.testing.assert_close(got.float(), ref, rtol=rtol, atol=1e-4 * scale)


def _layer(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _backends() -> list[str]:
    from dflash2.kernels.amx import amx_available
    from dflash2.kernels.dpbf16 import dpbf16_available

    if not kernels_available():
        return ["torch"]
    return ["amx"] * amx_available() + ["avx512bf16"] * dpbf16_available() + ["avx2", "torch"]


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("n,k", list(itertools.product(OUT, IN)))
def test_matches_reference(backend: str, n: int, k: int) -> None:
    for bias in (False, True):
        lin = _layer(n, k, bias, seed=n * 7919 + k)
        w16 = lin.weight.detach().to(torch.bfloat16)
        layer = PackedLinear.from_linear(lin, backend=backend)
        assert (layer.in_features, layer.out_features, layer.backend) == (k, n, backend)
        g = torch.Generator().manual_seed(k + n)
        for m in ROWS:
            x32 = torch.randn(m, k, generator=g)
            for x in (x32, x32.to(torch.bfloat16)):
                y = layer(x)
                assert y.dtype == x.dtype and y.shape == (m, n)
                ref = _reference(x, w16, lin.bias)
                # A bf16 result is the fp32 one rounded once: within half a bf16 ulp (2^-9).
                _assert_close(y, ref, x, w16, rtol=1e-4 if x.dtype == torch.float32 else 2**-8)


@needs_kernel
def test_fallback_matches_kernel() -> None:
    torch.manual_seed(0)
    for n, k, m in ((100, 40, 17), (24, 1536, 9), (64, 300, 300)):
        lin = _layer(n, k, True, seed=n + k)
        fast = PackedLinear.from_linear(lin, backend="avx2")
        slow = PackedLinear.from_linear(lin, backend="torch")
        x = torch.randn(m, k)
        _assert_close(fast(x), slow(x), x, lin.weight)
        assert torch.equal(fast.unpacked_weight(), slow.unpacked_weight())


@needs_kernel
def test_thread_count_does_not_change_results() -> None:
    before = torch.get_num_threads()
    lin = _layer(1000, 1536, True, seed=3)
    layer = PackedLinear.from_linear(lin, backend="avx2")
    g = torch.Generator().manual_seed(1)
    try:
        for m in (1, 5, 16, 70):
            x = torch.randn(m, 1536, generator=g)
            torch.set_num_threads(1)
            y1 = layer(x)
            torch.set_num_threads(2)
            y2 = layer(x)
            assert torch.equal(y1, y2), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", _backends())
def test_unpacked_weight_round_trip_is_exact(backend: str) -> None:
    for n, k in ((8, 16), (100, 40), (37, 3), (1, 1)):
        w = torch.randn(n, k, dtype=torch.float32)
        layer = PackedLinear.from_linear(_linear_with(w), backend=backend)
        back = layer.unpacked_weight()
        assert back.dtype == torch.bfloat16 and back.shape == (n, k)
        assert torch.equal(back, w.to(torch.bfloat16))
        # A bf16 weight goes through untouched, and a second round trip is the identity.
        again = PackedLinear.from_linear(_linear_with(back), backend=backend).unpacked_weight()
        assert torch.equal(again, back)
    packed = pack_weight(w)
    assert packed.shape == (1, 1, 16) and torch.equal(unpack_weight(packed, 1), back)


def _linear_with(w: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def test_pack_layout() -> None:
    # Word i of panel p at column k: low half W[16p + i], high half W[16p + 8 + i].
    n, k = 20, 3
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    packed = pack_weight(w)
    assert packed.shape == (2, k, 16) and packed.dtype == torch.bfloat16
    for p, kk, i, h in itertools.product(range(2), range(k), range(8), range(2)):
        row = 16 * p + 8 * h + i
        expect = float(w[row, kk]) if row < n else 0.0
        assert float(packed[p, kk, 2 * i + h]) == expect


@pytest.mark.parametrize("backend", _backends())
def test_shapes_dtypes_and_state(backend: str) -> None:
    lin = _layer(24, 40, True, seed=5).to(torch.float16)
    layer = PackedLinear.from_linear(lin, backend=backend)
    x = torch.randn(2, 3, 40, dtype=torch.float16)
    y = layer(x)
    assert y.shape == (2, 3, 24) and y.dtype == torch.float16
    ref = _reference(x.reshape(6, 40), lin.weight.to(torch.bfloat16), lin.bias).view(2, 3, 24)
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3)
    # Non-contiguous input, empty batch.
    xt = torch.randn(40, 5).t()
    torch.testing.assert_close(layer(xt), _reference(xt, lin.weight.to(torch.bfloat16), lin.bias))
    assert layer(torch.randn(0, 40)).shape == (0, 24)
    # Only the packed weight (bf16) and the fp32 bias are held; no parameters or buffers.
    assert list(layer.parameters()) == [] and list(layer.buffers()) == []
    assert layer.weight_data.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    with pytest.raises(ValueError):
        layer(torch.randn(2, 41))


def test_unknown_backend_rejected() -> None:
    with pytest.raises(ValueError):
        PackedLinear.from_linear(nn.Linear(4, 4), backend="cuda")


def test_env_var_forces_fallback() -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as ws:\n"
        "    warnings.simplefilter('always')\n"
        "    from dflash2.kernels import kernels_available, kernel_status, PackedLinear\n"
        "    import torch\n"
        "    ok = kernels_available(); kernels_available()\n"
        "    layer = PackedLinear.from_linear(torch.nn.Linear(8, 3))\n"
        "msgs = [str(w.message) for w in ws if 'dflash2' in str(w.message)]\n"
        "print(ok, layer.backend, len(msgs), kernel_status())\n"
        "print(msgs[0])\n"
    )
    env = dict(os.environ, DFLASH2_KERNELS="off")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0].startswith("False torch 1 disabled by DFLASH2_KERNELS=off"), out
    assert "fallback" in out[1] and "\n" not in out[1]


def test_build_failure_falls_back_with_warning(tmp_path) -> None:
    code = (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as ws:\n"
        "    warnings.simplefilter('always')\n"
        "    from dflash2.kernels import kernels_available, kernel_status\n"
        "    ok = kernels_available()\n"
        "print(ok, sum('dflash2' in str(w.message) for w in ws))\n"
        "print(kernel_status())\n"
    )
    env = dict(os.environ, DFLASH2_HOME=str(tmp_path), CXX="/bin/false", DFLASH2_KERNELS="on")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == "False 1", out
    assert "kernel build failed in" in out[1], out


@pytest.mark.skipif(not kernels_available(), reason="packed kernel unavailable")
@pytest.mark.parametrize("n,k", [(100, 1536), (33, 32), (48, 320)])
def test_kernel_is_row_count_invariant(n: int, k: int) -> None:
    """Row r of the output is bitwise the same whatever the number of rows in the call: verifying a draft block
    computes exactly what plain decoding computes (1- and 2-row calls, row blocks and k blocks included)."""
    assert_row_count_invariant(PackedLinear.from_linear(_layer(n, k, bias=True, seed=3), backend="avx2"), k)


def assert_row_count_invariant(layer, k: int) -> None:
    """Calls of 1..19 rows and single rows equal the same rows of one call long enough to be cut into row
    blocks (prefill), bitwise."""
    from dflash2.kernels.packed_linear import ROW_BLOCK

    x = torch.randn(ROW_BLOCK + 70, k, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        full = layer(x)
        for m in range(1, 20):
            assert torch.equal(layer(x[:m]), full[:m]), m
        for r in (0, 5, 17, ROW_BLOCK - 1, ROW_BLOCK + 3):
            assert torch.equal(layer(x[r : r + 1]), full[r : r + 1]), r


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not kernels_available() or not _cpu_has_avx512(), reason="needs the kernel and AVX-512")
@pytest.mark.parametrize("n,k", [(100, 1536), (48, 320), (33, 7)])
def test_avx512_calls_equal_avx2_calls_bitwise(n: int, k: int) -> None:
    """Calls of 4..12 rows take the AVX-512 micro-kernel where the CPU has it; every output stays one in-order
    FMA chain, so forcing AVX2 (isa=1) must give the same bits for every row count."""
    op = torch.ops.dflash2_kernels.packed_linear_tuned
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    packed, bias = pack_weight(weight), torch.randn(n, generator=gen)
    x = torch.randn(40, k, generator=gen)
    for m in (1, 3, 4, 7, 8, 9, 12, 13, 16, 25, 40):
        rows = x[:m].contiguous()
        assert torch.equal(op(rows, packed, bias, n, 0, 0, 0), op(rows, packed, bias, n, 0, 0, 1)), m
