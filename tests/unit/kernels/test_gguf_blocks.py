"""--weights gguf: the GGUF's own blocks (kernels/gguf_blocks.py), their kernel (kernels/gguf_linear.py,
gemm_gguf_avx2.cpp) and the model store's cache of them (models/gguf_cache.py)."""

from __future__ import annotations

import contextlib
import os
import platform

import numpy as np
import pytest
import torch

from dflash2.kernels import gguf_linear as gl
from dflash2.kernels.gguf_blocks import (SUPPORTED_TYPES, GGUFBlockError, concat_rows, decode_blocks, dequantize,
                                         random_blocks, random_raw, take_rows)
from dflash2.platform import Settings, cpu, gguf_pair_min_rows, reload_settings

gguf_quants = pytest.importorskip("gguf.quants")
GGML = pytest.importorskip("gguf").GGMLQuantizationType


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_dequantize_is_ggufs_bit_for_bit(qtype):
    n, k = 24, 512
    raw = random_raw(qtype, n, k, seed=5)
    ref = gguf_quants.dequantize(raw, GGML[qtype]).reshape(n, k)
    got = dequantize(decode_blocks(qtype, raw, n, k))
    assert np.array_equal(_bits(got), _bits(ref))  # signed zeros included


def test_store_ggufs_dequantize_bit_for_bit():
    """The store's SmolLM2 file (Q4_1 and Q8_0), where it has been pulled."""
    from dflash2.models.store import gguf_path

    path = gguf_path("smollm2-135m-instruct")
    if not path.is_file():
        pytest.skip("SmolLM2's GGUF is not in the store")
    reader = __import__("gguf").GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.name not in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
            continue
        k = int(tensor.shape[0])
        data = np.asarray(tensor.data)[:40]
        ref = gguf_quants.dequantize(data, tensor.tensor_type).reshape(40, k)
        assert np.array_equal(_bits(dequantize(decode_blocks(tensor.tensor_type.name, data, 40, k))), _bits(ref))


def test_unsupported_types_and_shapes_are_clear_errors():
    with pytest.raises(GGUFBlockError, match="Q5_K is not supported"):
        decode_blocks("Q5_K", np.zeros((1, 176), np.uint8), 1, 256)
    with pytest.raises(GGUFBlockError, match="multiple of 256"):
        decode_blocks("Q4_K", np.zeros((1, 144), np.uint8), 1, 128)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_pack_unpack_round_trip(qtype):
    t = random_blocks(qtype, 37, 256, seed=2)  # 37 rows: a partial panel
    u = gl.unpack_blocks(gl.pack_blocks(t))
    for name in ("codes", "sub_scales", "scale", "offset", "offset_mult"):
        a, b = getattr(t, name), getattr(u, name)
        assert (a is None and b is None) or np.array_equal(a, b), name


def test_rows_take_and_concat_are_exact():
    t = random_blocks("Q4_K", 16, 256, seed=3)
    perm = np.random.default_rng(0).permutation(16)
    assert np.array_equal(dequantize(take_rows(t, perm)), dequantize(t)[perm])
    both = concat_rows([take_rows(t, np.arange(8)), take_rows(t, np.arange(8, 16))])
    assert np.array_equal(dequantize(both), dequantize(t))


def test_quantized_rows_reference():
    x = torch.randn(3, 64)
    x[1, :32] = 0  # an all-zero block: scale 0, codes 0
    xq, dx, bsum = gl.quantize_rows(x)
    assert dx[1, 0] == 0 and not xq[1, :32].any()
    assert xq.abs().max() == 127
    back = (xq.float().view(3, 2, 32) * dx[..., None]).view(3, 64)
    assert torch.allclose(back, x, atol=float(dx.max()) / 2 + 1e-7)
    assert torch.equal(bsum, xq.int().view(3, 4, 16).sum(2))


def test_reference_is_close_to_the_dequantized_product():
    t = random_blocks("Q6_K", 40, 512, seed=4)
    x = torch.randn(5, 512)
    y = gl.reference_rows(x, t)
    exact = x.double() @ torch.from_numpy(dequantize(t)).double().T
    assert ((y.double() - exact).abs().max() / exact.abs().max()) < 0.02  # int8 activations: ~0.5% here


needs_kernel = pytest.mark.skipif(not gl.gguf_kernels_available(), reason="the gguf AVX2 kernel is unavailable")
# Every kernel build this CPU runs (AVX2; AVX512-VNNI and AMX-INT8 where the CPU has them): each must give the
# reference's bits.
KERNELS = [pytest.param(gl.KERNEL, marks=needs_kernel),
           *(pytest.param(b, marks=pytest.mark.skipif(not gl.gguf_kernels_available(b),
                                                      reason=f"gguf {b}: {gl.gguf_kernel_status(b)}"))
             for b in (gl.VNNI, gl.AMX))]


def _op(backend: str = gl.KERNEL):
    return gl.kernel_ops(backend)


@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_quantizes_rows_like_the_reference(backend):
    _, quantize = _op(backend)
    x = torch.randn(9, 512) * torch.logspace(-3, 3, 512)
    x[2, 256:512] = 0
    x[3, :32] = torch.linspace(-100, 100, 32)
    x[3, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # amax 127: d = 1, exact ties rounded to even (2, -4, 0)
    x[4, :256] *= 1e-33  # tiny and huge scales
    x[4, 256:] *= 1e33
    x[5, :4] = torch.tensor([127.0, 2.5 + 2**-20, -3.5 - 2**-20, 0.5])  # just past ties (3, -4)
    x[6:8] = 0  # x = amax / 2: the IEEE quotient x / d, not x * (1 / d), on the other side of 63.5
    x[6, :3] = torch.tensor([1.125, 0.5625, -0.5625])  # x / d = 63.4999962 (x * (1 / d) = 63.5)
    x[7, :3] = torch.tensor([1.1875, 0.59375, -0.59375])  # x / d = 63.5 (x * (1 / d) = 63.4999962)
    many = torch.randn(64, 4096, generator=torch.Generator().manual_seed(3))
    x = torch.cat([x, many[:, :512], many[:, 512:1024] * 1e-20])
    for block in (32, 256):
        for rows in (x, x.bfloat16()):  # bf16 rows as they are: their exact fp32 widening's result
            for a, b in zip(quantize(rows, block), gl.quantize_rows(rows.float(), block)):
                assert torch.equal(a, b)
    assert quantize(x, 32)[0][3, :4].tolist() == [127, 2, -4, 0]
    assert quantize(x, 32)[0][5, :4].tolist() == [127, 3, -4, 0]
    assert quantize(x, 256)[0][6:8, :3].tolist() == [[127, 63, -63], [127, 64, -64]]


@contextlib.contextmanager
def _pairs_from(backend: str, rows: int):
    """The build's panels in pairs from `rows` rows (gguf_pair_min_rows) inside the block, its setting restored."""
    op = getattr(torch.ops, gl.build_namespace(backend)).gguf_pair_min_rows
    before = op()
    op(rows)
    try:
        yield
    finally:
        op(before)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_kernel_equals_reference_and_is_row_count_invariant(qtype, backend):
    op, quantize = _op(backend)
    k = 512
    t = random_blocks(qtype, 44, k, seed=7)  # 44 outputs: 5 full panels and a partial one
    pb = gl.pack_blocks(t)
    block = gl.activation_block(t)
    x = torch.randn(40, k)
    full = gl._matmul(op, quantize(x, block), pb)
    assert torch.equal(full, gl.reference_rows(x, t))
    # the VNNI / AMX builds with 1-4 rows on the 256-bit kernel and on the pairs
    for pairs_from in (1, 5) if backend != gl.KERNEL else (0,):
        with _pairs_from(backend, pairs_from) if pairs_from else contextlib.nullcontext():
            for m in range(1, 41):  # every row-block split of the kernel (1..4 rows per call; VNNI pairs: 1..12;
                # AMX: tile chunks of <= 16 rows, evenly sized, over zero-padded rows)
                assert torch.equal(gl._matmul(op, quantize(x[:m], block), pb), full[:m]), (m, pairs_from)
            for r in (0, 13, 39):
                assert torch.equal(gl._matmul(op, quantize(x[r : r + 1], block), pb), full[r : r + 1])


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0"])
def test_kernel_over_every_grouping_of_panels_equals_the_reference(qtype, backend):
    # The kinds without sub-scales, whose pair micro-kernel (plain_pair_rows) sums each row and block in one chain:
    # even and odd panel counts (a lone last panel), 1-11 rows per call.
    op, quantize = _op(backend)
    x = torch.randn(11, 256)
    for n in (8, 16, 20, 24, 32, 36, 40, 56, 64, 72):
        t = random_blocks(qtype, n, 256, seed=n)
        pb = gl.pack_blocks(t)
        full = gl.reference_rows(x, t)
        with _pairs_from(backend, 1) if backend != gl.KERNEL else contextlib.nullcontext():
            for m in (1, 2, 4, 5, 6, 9, 11):
                assert torch.equal(gl._matmul(op, quantize(x[:m], 32), pb), full[:m]), (n, m)


def _loaded_library(namespace: str) -> str | None:
    """The path of the loaded shared library whose name starts with ``namespace``, from /proc/self/maps."""
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(namespace + "_") and path.endswith(".so"):
                return path
    return None


@pytest.mark.skipif(not gl.gguf_kernels_available(gl.VNNI), reason="needs the gguf VNNI build")
def test_every_pair_micro_kernel_prefetches_its_codes():
    # GCC 12 once deleted every prefetch of the pairs (an out-of-line prefetch_pair counted as const): the same bits,
    # so only the machine code shows it. Each pair_rows / plain_pair_rows instantiation must hold PREFETCHT0.
    import shutil
    import subprocess

    gl.kernel_ops(gl.VNNI)
    library = _loaded_library(gl.build_namespace(gl.VNNI))
    if library is None or shutil.which("objdump") is None:
        pytest.skip("needs /proc/self/maps and objdump")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True,
                             check=True).stdout
    bodies = [body for body in listing.split("\n\n")
              if any(name in body.split("\n", 1)[0] for name in ("::pair_rows<", "::plain_pair_rows<"))]
    assert bodies, "no pair_rows functions found"
    missing = [body.split("\n", 1)[0] for body in bodies if "prefetcht0" not in body]
    assert not missing, missing[:3]


def test_pair_rows_are_four_unless_the_setting_says_otherwise():
    unset = Settings.from_environ({})
    assert gguf_pair_min_rows(unset) == 4
    assert gguf_pair_min_rows(Settings.from_environ({gl.PAIRS_ENV: "3"})) == 3
    assert gguf_pair_min_rows(Settings(gguf_pair_rows=7)) == 7
    for bad in ("0", "-2", "many"):
        with pytest.raises(ValueError, match=gl.PAIRS_ENV):
            gguf_pair_min_rows(Settings.from_environ({gl.PAIRS_ENV: bad}))
    assert gl.pair_min_rows() == gguf_pair_min_rows(unset)  # (no DFLASH2_GGUF_PAIR_ROWS in the tests)


def test_cpu_model_reads_this_machine():
    vendor, family = cpu().vendor, cpu().family
    if os.path.exists("/proc/cpuinfo") and platform.machine() in ("x86_64", "AMD64"):
        assert vendor and family > 0  # every x86 Linux lists vendor_id and cpu family
    elif not os.path.exists("/proc/cpuinfo"):
        assert (vendor, family) == ("", -1)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q4_1"])
def test_kernel_on_many_rows_equals_the_reference(qtype, backend):
    # AMX: passes of <= 64 rows (several of them, the last one short), each in tile chunks over zero-padded rows
    op, quantize = _op(backend)
    t = random_blocks(qtype, 24, 512, seed=9)
    x = torch.randn(150, 512)
    assert torch.equal(gl._matmul(op, quantize(x, gl.activation_block(t)), gl.pack_blocks(t)), gl.reference_rows(x, t))


@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_is_exact_at_the_integer_extremes(backend):
    # Q4_K at its largest integers: sub-scales and minimums 63, codes 15, activation bytes +-127. The AMX build
    # folds s * u into two bytes (16 s1 + s0: s0 * u <= 225 must not carry into the next byte) and sums the offset
    # term from int16 block sums of x: a carry or an overflow anywhere shows here.
    op, quantize = _op(backend)
    t = random_blocks("Q4_K", 40, 512, seed=3)
    rng = np.random.default_rng(3)
    t.codes[:] = np.where(rng.random(t.codes.shape) < 0.8, 15, t.codes)
    t.sub_scales[:] = np.where(rng.random(t.sub_scales.shape) < 0.8, 63, t.sub_scales)
    t.offset_mult[:] = 63
    x = torch.where(torch.rand(17, 512) < 0.5, -1.0, 1.0) * torch.rand(17, 1).add(0.5)  # one magnitude per row
    x[3] = 1.0  # every byte +127
    x[4, :256] = -1.0
    x[4, 256:] = 1.0
    for rows in (x[:1], x[:4], x[:9], x):
        got = gl._matmul(op, quantize(rows, gl.activation_block(t)), gl.pack_blocks(t))
        assert torch.equal(got, gl.reference_rows(rows, t)), rows.shape[0]


@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_is_thread_count_invariant(backend):
    op, quantize = _op(backend)
    pb = gl.pack_blocks(random_blocks("Q4_K", 520, 1024, seed=8))
    x = torch.randn(9, 1024)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gl._matmul(op, quantize(x, 256), pb)
        torch.set_num_threads(2)
        assert torch.equal(gl._matmul(op, quantize(x, 256), pb), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", KERNELS)
def test_layer_with_mixed_runs_and_bias_equals_the_torch_backend(backend):
    parts = [gl.pack_blocks(random_blocks(q, n, 256, seed=i)) for i, (q, n) in
             enumerate((("Q4_K", 64), ("Q8_0", 16), ("Q6_K", 16)))]  # activations per 256 and per 32
    bias = torch.randn(96)
    kernel, torch_layer = gl.GgufLinear(parts, bias, backend), gl.GgufLinear(parts, bias, "torch")
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    y = kernel(x)
    assert y.shape == (2, 7, 96) and y.dtype == torch.bfloat16
    assert torch.equal(y, torch_layer(x))
    assert torch.equal(kernel(x[:, :1]), y[:, :1])
    w = kernel.dequantized_weight()
    assert w.shape == (96, 256)
    # the one-call C++ layer (gguf_linear) computes what the Python path of CpuLinear.forward computes, bit for bit:
    # every input dtype, non-contiguous rows, more rows than one kernel call takes
    from dflash2.kernels.packed_linear import CpuLinear

    for rows in (torch.randn(300, 256), torch.randn(3, 256, dtype=torch.float16), torch.randn(256, 5).T,
                 torch.randn(1, 1, 256, dtype=torch.bfloat16)):
        got = kernel(rows)
        assert got.dtype == rows.dtype and torch.equal(got, CpuLinear.forward(kernel, rows))
    with pytest.raises(RuntimeError, match="expected last dim 256"):
        kernel(torch.randn(2, 128))


@pytest.mark.parametrize("backend", KERNELS)
def test_outputs_stored_in_place_with_bias_and_rounding(backend):
    """Each run's outputs go to their columns with the bias added and bf16 rounding done in the kernel's store:
    runs that end mid-panel (60 + 12 + 20 outputs), every micro-kernel's row count, against the torch backend;
    forward_float (bf16 outputs widened to fp32 as they are stored) against the bf16 outputs widened."""
    parts = [gl.pack_blocks(random_blocks(q, n, 256, seed=i)) for i, (q, n) in
             enumerate((("Q4_K", 60), ("Q8_0", 12), ("Q6_K", 20)))]
    bias = torch.randn(92, generator=torch.Generator().manual_seed(5))
    for b in (bias, None):
        kernel, torch_layer = gl.GgufLinear(parts, b, backend), gl.GgufLinear(parts, b, "torch")
        for rows in (1, 3, 4, 5, 9, 17, 33):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            for dtype in (torch.float32, torch.bfloat16):
                got = kernel(x.to(dtype))
                assert got.dtype == dtype and torch.equal(got, torch_layer(x.to(dtype))), (rows, dtype, b is None)
                widened = kernel.forward_float(x.to(dtype))  # the head's logits: rounded as dtype, stored as fp32
                assert widened.dtype == torch.float32 and torch.equal(widened, got.float()), (rows, dtype)
        half = x.half()
        assert torch.equal(kernel.forward_float(half), kernel(half).float())


@pytest.mark.parametrize("backend", ["torch", *KERNELS])
def test_selected_rows_give_those_outputs_bitwise(backend):
    """A drafter's head over a draft vocabulary: any rows, in any order, across runs of different block types."""
    parts = [gl.pack_blocks(random_blocks(q, n, 256, seed=i)) for i, (q, n) in
             enumerate((("Q4_K", 40), ("Q8_0", 16), ("Q6_K", 20)))]
    bias = torch.randn(76)
    layer = gl.GgufLinear(parts, bias, backend)
    rows = torch.tensor([3, 0, 39, 45, 41, 70, 56, 2, 75, 44])  # crosses runs, out of order, a partial panel
    sub = layer.select_rows(rows)
    x = torch.randn(5, 256)
    assert sub.out_features == len(rows)
    assert torch.equal(sub(x), layer(x)[:, rows])
    assert torch.equal(sub.dequantized_weight(), layer.dequantized_weight()[rows])
    with pytest.raises(ValueError, match="rows must lie"):
        layer.select_rows(torch.tensor([76]))


@pytest.mark.parametrize("backend", ["torch", *KERNELS])
def test_q8_0_from_a_float_weight(backend):
    """quantize_q8_0: fp16 scales per 32 inputs, codes within half a step of w / d; the layer over them equals the
    reference on those blocks and is close to the float product."""
    from dflash2.kernels.gguf_quantize import quantize_q8_0

    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 256, generator=g) * torch.logspace(-2, 1, 40)[:, None]
    w[3, 32:64] = 0  # an all-zero block: scale 0, codes 0
    t = quantize_q8_0(w.numpy())
    assert t.qtype == "Q8_0" and t.signed and t.scale.shape == (40, 8)
    assert np.array_equal(t.scale, t.scale.astype(np.float16).astype(np.float32))
    assert not t.codes.view(np.int8)[3, 32:64].any() and t.scale[3, 1] == 0
    step = np.repeat(t.scale, 32, axis=1)
    assert np.all(np.abs(dequantize(t) - w.numpy()) <= 0.5 * step + 1e-6 * np.abs(w.numpy()))
    _check_layer_over(t, w, backend, "Q8_0", g, 0.02)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 40), np.float32))


def _numpy_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 [N, B, 32], scale fp32 [N, B]): Q8_0's definition evaluated in numpy (fp32 throughout)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    with np.errstate(over="ignore"):
        d = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, np.float32(1))
    return np.where(d[..., None] > 0, np.clip(np.rint(blocks / safe[..., None]), -127, 127), 0).astype(np.int8), d


def _numpy_q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 [N, B, 32], scale fp32 [N, B]): Q4_0's definition evaluated in numpy (fp32 throughout)."""
    blocks = w.reshape(w.shape[0], -1, 32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], axis=2)[..., 0]
    with np.errstate(over="ignore"):
        d = (largest / np.float32(-8)).astype(np.float16).astype(np.float32)
    safe = np.where(d != 0, d, np.float32(1))
    codes = np.where(d[..., None] != 0, np.clip(np.rint(blocks / safe[..., None]) + 8, 0, 15), 8).astype(np.uint8)
    return codes, d


def test_float_quantizers_equal_their_numpy_definition_bit_for_bit():
    """quantize_q8_0 / quantize_q4_0 run in PyTorch by chunks of rows (seconds for the 0.5B drafter, not tens); their
    codes and scales are those of the same fp32 arithmetic in numpy: ties rounded to even, zero blocks, a largest
    magnitude shared by two inputs (the first is taken), scales past fp16's range, more rows than one chunk; a bf16
    weight quantizes as its exact fp32 widening does."""
    from dflash2.kernels import gguf_quantize as gq

    g = torch.Generator().manual_seed(11)
    rows = gq._QUANTIZE_ELEMENTS // 96 + 37
    w = torch.randn(rows, 96, generator=g) * torch.logspace(-3, 2, rows)[:, None]
    w[0, :32] = 0
    w[1, :32] = torch.arange(32) * 0.25 - 4  # steps of a quarter: ties of w / d at 127 / 4 ... (exact halves)
    w[2, 32:64] = torch.tensor([-3.0, 3.0] * 16)  # the largest magnitude twice, with opposite signs
    w[3, 64:96] = 1e7  # past fp16 after / 127 and / -8: infinite scales
    for quantize, reference in ((gq.quantize_q8_0, _numpy_q8_0), (gq.quantize_q4_0, _numpy_q4_0)):
        for weight in (w, w.numpy()):  # a torch tensor or a numpy array
            t = quantize(weight)
            codes, scale = reference(w.numpy())
            assert np.array_equal(t.codes.reshape(codes.shape).view(codes.dtype), codes), quantize.__name__
            assert np.array_equal(t.scale.view(np.uint32), scale.view(np.uint32)), quantize.__name__
        half = w.to(torch.bfloat16)
        t, (codes, scale) = quantize(half), reference(half.float().numpy())
        assert np.array_equal(t.codes.reshape(codes.shape).view(codes.dtype), codes), quantize.__name__
        assert np.array_equal(t.scale.view(np.uint32), scale.view(np.uint32)), quantize.__name__


def _check_layer_over(t, w, backend, qtype, g, tolerance):
    """GgufLinear.from_weight(w) over ``qtype`` blocks computes the reference over ``t``, within ``tolerance`` (of
    the largest output) of the float product."""
    layer = gl.GgufLinear.from_weight(w, torch.randn(w.shape[0], generator=g), backend, qtype=qtype)
    x = torch.randn(3, w.shape[1], generator=g)
    y = layer(x)
    assert torch.equal(y, gl.reference_rows(x, t) + layer.bias_data)
    exact = x @ w.T + layer.bias_data
    assert float((y - exact).abs().max() / exact.abs().max()) < tolerance


@pytest.mark.parametrize("backend", ["torch", *KERNELS])
def test_q4_0_from_a_float_weight(backend):
    """quantize_q4_0: fp16 scales per 32 inputs (the largest magnitude at code 0), codes in [0, 15] within half a
    step of w / d + 8 (a step at 15: the side opposite the largest has 7 steps); the layer over them equals the
    reference on those blocks and is near the float product."""
    from dflash2.kernels.gguf_quantize import quantize_q4_0

    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 256, generator=g) * torch.logspace(-2, 1, 40)[:, None]
    w[3, 32:64] = 0  # an all-zero block: scale 0, codes 8 (zero)
    t = quantize_q4_0(w.numpy())
    assert t.qtype == "Q4_0" and not t.signed and t.zero == 8 and t.scale.shape == (40, 8)
    assert np.array_equal(t.scale, t.scale.astype(np.float16).astype(np.float32))
    assert t.codes.max() <= 15 and np.all(t.codes[3, 32:64] == 8) and t.scale[3, 1] == 0
    largest = np.abs(w.numpy().reshape(40, 8, 32)).argmax(axis=2)
    assert np.all(np.take_along_axis(t.codes.reshape(40, 8, 32), largest[..., None], 2)[[0, 5, 39]] == 0)
    step = np.repeat(np.abs(t.scale), 32, axis=1)
    half = np.where(t.codes == 15, 1.0, 0.5)  # half a step, one where the side opposite the largest is clipped
    assert np.all(np.abs(dequantize(t) - w.numpy()) <= half * step + 1e-3 * np.abs(w.numpy()))
    _check_layer_over(t, w, backend, "Q4_0", g, 0.15)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4_0(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="Q8_0 or Q4_0"):
        gl.GgufLinear.from_weight(w, None, backend, qtype="Q6_K")


def test_backend_switch(monkeypatch):
    monkeypatch.setenv(gl.ENV, "torch")
    reload_settings()
    assert gl.gguf_backend() == "torch"
    monkeypatch.setenv(gl.ENV, "maybe")
    reload_settings()
    with pytest.raises(ValueError, match="expected amx, vnni, avx2 or torch"):
        gl.gguf_backend()


@needs_kernel
def test_default_backend_is_the_fastest_kernel_here_and_a_named_one_is_required(monkeypatch):
    monkeypatch.delenv(gl.ENV, raising=False)
    monkeypatch.delenv("DFLASH2_AMX", raising=False)
    reload_settings()
    has_vnni, has_amx = gl.gguf_kernels_available(gl.VNNI), gl.gguf_kernels_available(gl.AMX)
    assert gl.gguf_backend() == (gl.AMX if has_amx else gl.VNNI if has_vnni else gl.KERNEL)
    monkeypatch.setenv("DFLASH2_AMX", "off")  # the machine-wide AMX switch keeps the VNNI build
    reload_settings()
    assert gl.gguf_backend() == (gl.VNNI if has_vnni else gl.KERNEL)
    monkeypatch.setenv(gl.ENV, "amx")
    reload_settings()
    if has_amx:
        assert gl.gguf_backend() == gl.AMX
    else:
        with pytest.raises(RuntimeError, match="amx-int8 kernel, which is unavailable"):
            gl.gguf_backend()
    monkeypatch.setenv(gl.ENV, "avx2")
    reload_settings()
    assert gl.gguf_backend() == gl.KERNEL
    monkeypatch.setenv(gl.ENV, "vnni")
    reload_settings()
    if has_vnni:
        assert gl.gguf_backend() == gl.VNNI
    else:  # named and unavailable: an error naming why, not a silent fallback
        with pytest.raises(RuntimeError, match="avx512-vnni kernel, which is unavailable"):
            gl.gguf_backend()


def test_cache_round_trip_and_invalidation(tmp_path, monkeypatch):
    from dflash2.models.config import ModelConfig
    from dflash2.models.gguf_cache import GgufCache

    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path))
    reload_settings()
    model_dir = tmp_path / "models" / "tiny" / "bf16"
    model_dir.mkdir(parents=True)
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"stand-in")
    config = ModelConfig(vocab_size=16, hidden_size=256, intermediate_size=256, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=128)
    layers = {}
    for i, name in enumerate(("layers.0.attn.wqkv", "layers.0.attn.wo", "layers.0.ffn.w_gate_up",
                              "layers.0.ffn.w_down", "lm_head")):
        parts = [gl.pack_blocks(random_blocks(q, 8, 256, seed=i)) for q in ("Q4_K", "Q6_K")]
        layers[name] = (parts, torch.randn(16) if i == 0 else None)
    cache = GgufCache.for_model(model_dir, gguf)
    assert cache is not None and cache.read(config) is None
    cache.write(layers)
    back = cache.read(config)
    for name, (parts, bias) in layers.items():
        got_parts, got_bias = back[name]
        assert (bias is None) == (got_bias is None) and (bias is None or torch.equal(bias, got_bias))
        for a, b in zip(parts, got_parts, strict=True):
            assert a.meta() == b.meta()
            assert all(torch.equal(t, b.tensors()[n]) for n, t in a.tensors().items())
    os.utime(gguf, ns=(1, 1))  # another file: the cache no longer matches
    with pytest.warns(RuntimeWarning, match="ignoring the gguf block cache"):
        assert GgufCache.for_model(model_dir, gguf).read(config) is None
    monkeypatch.setenv("DFLASH2_QUANT_CACHE", "off")
    reload_settings()
    assert GgufCache.for_model(model_dir, gguf) is None
