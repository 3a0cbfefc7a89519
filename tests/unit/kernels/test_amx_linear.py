"""The paths of PackedLinear on the AMX weight layout, AMX tiles (dflash2.kernels.amx) and AVX512-BF16
(dflash2.kernels.dpbf16): layout, accuracy, row-count invariance (what keeps speculation lossless in bf16),
thread-count independence, the switches that turn them off; int8 on AMX."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dflash2.kernels import PackedLinear
from dflash2.kernels.amx import amx_available, amx_status, pack_int8_amx, pack_weight_amx, unpack_weight_amx
from dflash2.kernels.dpbf16 import dpbf16_available, dpbf16_status
from dflash2.kernels.quant_linear import QuantLinear, quantize_int8
from tests.unit.kernels.test_packed_linear import _layer, assert_row_count_invariant

needs_amx = pytest.mark.skipif(not amx_available(), reason=f"AMX unavailable: {amx_status()}")
needs_dpbf16 = pytest.mark.skipif(not dpbf16_available(), reason=f"AVX512-BF16 unavailable: {dpbf16_status()}")
TILE_BACKENDS = [pytest.param("amx", marks=needs_amx), pytest.param("avx512bf16", marks=needs_dpbf16)]


def _outputs_by_thread_count(layer, x: torch.Tensor) -> list[torch.Tensor]:
    """``layer(x)`` with 1, 2 and 3 torch threads."""
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append(layer(x))
    finally:
        torch.set_num_threads(before)
    return outs


def test_pack_layout_and_round_trip() -> None:
    """Element [p, s, r, 2c + h] holds W[16p + c, 32s + 2r + h]; padding is zero; unpacking is exact."""
    n, k = 37, 70
    w = torch.randn(n, k).to(torch.bfloat16)
    packed = pack_weight_amx(w)
    assert packed.shape == (3, 3, 16, 32) and packed.dtype == torch.bfloat16
    for p, s, r, c, h in ((0, 0, 0, 0, 0), (1, 2, 2, 3, 1), (2, 0, 15, 4, 1), (0, 1, 7, 15, 0)):
        assert packed[p, s, r, 2 * c + h] == w[16 * p + c, 32 * s + 2 * r + h]
    assert packed[2, 0, 0, 2 * 5] == 0  # output 37 is padding
    assert packed[0, 2, 3, 0] == 0  # k = 70 is padding
    assert torch.equal(unpack_weight_amx(packed, n, k), w)
    for n, k in ((48, 64), (1040, 4096)):  # whole panels and steps (no padded copy); 1040 x 4096: two chunks
        w = torch.randn(n, k)
        packed = pack_weight_amx(w)  # fp32 in: rounded to bf16 as .to(bf16) rounds
        assert torch.equal(unpack_weight_amx(packed, n, k), w.to(torch.bfloat16))
        assert packed[1, 1, 5, 2 * 7 + 1] == w[16 + 7, 32 + 11].to(torch.bfloat16)
        assert torch.equal(unpack_weight_amx(pack_weight_amx(w.to(torch.bfloat16)), n, k), w.to(torch.bfloat16))


@pytest.mark.parametrize("backend", TILE_BACKENDS)
@pytest.mark.parametrize("n,k", [(100, 1536), (33, 32), (48, 320), (70, 7), (20, 3000)])  # 3000: two k chunks
def test_row_count_invariant(n: int, k: int, backend: str) -> None:
    layer = PackedLinear.from_linear(_layer(n, k, bias=True, seed=3), backend=backend)
    assert_row_count_invariant(layer, k)  # fp32 rows (hi + lo parts)
    x = torch.randn(300, k).to(torch.bfloat16)  # bf16 rows, as in a bf16 model
    with torch.inference_mode():
        full = layer(x)
        for m in range(1, 34):
            assert torch.equal(layer(x[:m]), full[:m]), m


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_bf16_rows_are_exact_products(backend: str) -> None:
    """bf16 activations: each output is the fp32 sum of exact bf16 products (compare in float64)."""
    lin = _layer(40, 96, bias=True, seed=7)
    layer = PackedLinear.from_linear(lin, backend=backend)
    x = torch.randn(5, 96).to(torch.bfloat16)
    ref = F.linear(x.double(), lin.weight.detach().to(torch.bfloat16).double(), lin.bias.detach().double())
    with torch.inference_mode():
        got = layer(x.float())  # bf16-valued fp32 rows take the hi + lo path with lo = 0: same numbers
        assert torch.equal(layer(x).float(), got.to(torch.bfloat16).float())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_bf16_outputs_stored_by_the_kernel_equal_the_fp32_outputs_rounded(backend: str) -> None:
    """bf16 rows give bf16 outputs rounded in the kernel's store: bitwise the fp32 outputs' ``.to(bf16)``, with
    and without bias, a partial last panel, one row block and several (and int8 on AMX tiles)."""
    for n, k, bias in ((100, 1536, True), (33, 32, False), (70, 7, True)):
        layers = [PackedLinear.from_linear(_layer(n, k, bias=bias, seed=n), backend=backend)]
        if backend == "amx":
            from tests.unit.kernels.test_quant_linear import _weights

            w, b = _weights(n, k, seed=k)
            layers.append(QuantLinear.from_weight(w, b if bias else None, weights="int8", backend="amx"))
        for layer in layers:
            for m in (1, 5, 16, 17, 40):
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
                with torch.inference_mode():
                    got = layer(x)
                    assert got.dtype == torch.bfloat16
                    assert torch.equal(got, layer.kernel_rows(x).to(torch.bfloat16)), (type(layer), n, m)


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_fp32_rows_keep_fp32_accuracy(backend: str) -> None:
    """An fp32 x is split into two bf16 parts: far closer to the fp32 product than x rounded to bf16 once."""
    lin = _layer(64, 512, bias=False, seed=9)
    layer = PackedLinear.from_linear(lin, backend=backend)
    w = lin.weight.detach().to(torch.bfloat16).double()
    x = torch.randn(6, 512)
    ref = F.linear(x.double(), w)
    with torch.inference_mode():
        err = (layer(x).double() - ref).abs().max().item()
    once = (F.linear(x.to(torch.bfloat16).double(), w) - ref).abs().max().item()
    assert err < once / 50, (err, once)


@pytest.mark.parametrize("backend", TILE_BACKENDS)
def test_thread_count_does_not_change_results(backend: str) -> None:
    layer = PackedLinear.from_linear(_layer(1000, 256, bias=True, seed=11), backend=backend)
    x = torch.randn(9, 256).to(torch.bfloat16)
    outs = _outputs_by_thread_count(layer, x)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@needs_amx
def test_default_backend_is_amx_and_env_turns_it_off() -> None:
    assert PackedLinear.from_linear(torch.nn.Linear(8, 3)).backend == "amx"
    assert _backend_in_subprocess(DFLASH2_AMX="off", DFLASH2_DPBF16="off") == "avx2 disabled by DFLASH2_AMX=off"


@needs_dpbf16
def test_without_amx_the_default_backend_is_avx512bf16_and_env_turns_it_off() -> None:
    assert _backend_in_subprocess(DFLASH2_AMX="off").startswith("avx512bf16 ")
    assert _backend_in_subprocess(DFLASH2_AMX="off", DFLASH2_DPBF16="off").startswith("avx2 ")


def _backend_in_subprocess(**env: str) -> str:
    """The default PackedLinear backend and the AMX status in a fresh process with ``env`` set."""
    code = ("from dflash2.kernels import PackedLinear; import torch\n"
            "from dflash2.kernels.amx import amx_status\n"
            "print(PackedLinear.from_linear(torch.nn.Linear(8, 3)).backend, amx_status())\n")
    return subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=120, check=True).stdout.strip()


# int8 weights on AMX (QuantLinear backend "amx"): widened to bf16 tiles in the kernel, scale and bias after the sum.


@needs_amx
@pytest.mark.parametrize("n,k", [(100, 1536), (33, 32), (24, 96), (40, 70)])
def test_int8_matches_dequantized_reference(n: int, k: int) -> None:
    from tests.unit.kernels.test_quant_linear import _dequantized_reference, _tolerance, _weights

    w, b = _weights(n, k, seed=n + k)
    for bias in (None, b):
        layer = QuantLinear.from_weight(w, bias, weights="int8", backend="amx")
        q, scale = quantize_int8(w)
        assert all(torch.equal(a, e) for a, e in zip(layer.quantized(), (q, scale)))
        for m in (1, 3, 9, 16, 17, 40):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).float()
            with torch.inference_mode():
                got = layer(x)  # bf16-valued rows: exact products, fp32 sums
            ref = _dequantized_reference(x, q, scale, bias).float()
            torch.testing.assert_close(got, ref, rtol=0, atol=_tolerance(x, q, scale))


@needs_amx
def test_int8_wrong_layout_or_scale_is_caught() -> None:
    """The reference check above has teeth: a shifted layout or a neighbour's scale is far outside it."""
    from tests.unit.kernels.test_quant_linear import _dequantized_reference, _tolerance, _weights

    n, k = 100, 1536
    w, b = _weights(n, k, seed=1)
    q, scale = quantize_int8(w)
    x = torch.randn(9, k).to(torch.bfloat16).float()
    ref = _dequantized_reference(x, q, scale, b).float()
    for bad_q, bad_scale in ((q.roll(1, dims=1), scale), (q, scale.roll(1, dims=0))):
        layer = QuantLinear("int8", pack_int8_amx(bad_q), bad_scale, b, k, n, "amx")
        with torch.inference_mode():
            assert (layer(x) - ref).abs().max() > 100 * _tolerance(x, q, scale)


@needs_amx
@pytest.mark.parametrize("n,k", [(100, 1536), (48, 320), (70, 7)])
def test_int8_row_count_invariant(n: int, k: int) -> None:
    from tests.unit.kernels.test_quant_linear import _weights

    w, b = _weights(n, k, seed=3)
    layer = QuantLinear.from_weight(w, b, weights="int8", backend="amx")
    assert_row_count_invariant(layer, k)
    x = torch.randn(300, k).to(torch.bfloat16)
    with torch.inference_mode():
        full = layer(x)  # 300 rows: the group-widening path; up to 16 rows: the streamed path
        for m in range(1, 34):
            assert torch.equal(layer(x[:m]), full[:m]), m


@needs_amx
def test_int8_fp32_rows_and_threads() -> None:
    from tests.unit.kernels.test_quant_linear import _dequantized_reference, _weights

    w, b = _weights(200, 512, seed=5)
    layer = QuantLinear.from_weight(w, b, weights="int8", backend="amx")
    q, scale = quantize_int8(w)
    x = torch.randn(6, 512)
    ref = _dequantized_reference(x, q, scale, b)
    outs = _outputs_by_thread_count(layer, x)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    once = (_dequantized_reference(x.to(torch.bfloat16).float(), q, scale, b) - ref).abs().max().item()
    assert (outs[0].double() - ref).abs().max().item() < once / 50


def test_int4_has_no_amx_backend() -> None:
    with pytest.raises(ValueError, match="int8"):
        QuantLinear.from_weight(torch.randn(16, 32), weights="int4", backend="amx")
