"""A GGUF file's own quantized blocks, read as they are (no dequantize / requantize round trip).

Every supported block type (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) is read into one integer form, per weight row
``n`` (an output feature) and input ``k``::

    w[n, k] = A[n, k // (32 * group)] * float(s[n, k // sub] * (u[n, k] - zero)) (+ C[n, k // (32 * group)]
                                                                                   * float(c[n, k // 32]))

``u`` the weight's code (unsigned, 4 to 6 bits; Q8_0: the signed byte, ``zero`` 0), ``zero`` a power of two or 0,
``s`` an integer sub-scale per ``sub`` (16 or 32) inputs (None: 1), ``A`` / ``C`` the file's fp16 scales and
minimums as fp32 (exact), one per ``group`` blocks of 32 (K-quants: 8, one super-block of 256), ``c`` an integer
multiplier of ``C`` per 32 inputs (None: 1).  All of it is what the file stores, regrouped: Q4_K's
``(d * sc) * q - dmin * m`` is ``A = d``, ``s = sc``, ``C = -dmin``, ``c = m``; Q6_K's ``(d * sc) * (q - 32)`` is
``A = d``, ``s = sc`` per 16, ``zero = 32``.

:func:`dequantize` evaluates ``(A * s) * (u - zero) + C * c`` in fp32, grouped as gguf groups it, which equals
``gguf.quants.dequantize`` bit for bit (``A * s`` and ``C * c`` are exact: an fp16 times an integer of at most 8 bits).
What the kernels compute with it (activations quantized per row and block of 32) is in
:mod:`dflash2.kernels.gguf_linear`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BLOCK", "SUPPORTED_TYPES", "BlockTensor", "GGUFBlockError", "concat_rows", "decode_blocks",
           "dequantize", "integer_weights", "random_blocks", "random_raw", "take_rows"]

BLOCK = 32  # inputs per activation block and per kernel block
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
_QK_K = 256


class GGUFBlockError(ValueError):
    """A tensor whose blocks cannot be used as they are (type or shape), in words."""


@dataclass(frozen=True)
class BlockTensor:
    """One [N, K] weight in the integer form of the module docstring (numpy arrays, row-major)."""

    qtype: str  # the GGUF block type it was read from ("Q4_K", ...)
    codes: np.ndarray  # uint8 [N, K] (signed formats: int8 viewed as uint8)
    signed: bool  # codes are int8 (Q8_0)
    bits: int  # significant bits of the codes: 4 (packed two per byte by the kernel), 5, 6 or 8
    zero: int  # subtracted from every code: 0, 8, 16 or 32
    sub: int  # inputs per sub-scale: 16 or 32
    sub_scales: np.ndarray | None  # int8 [N, K / sub]; None: all 1
    group: int  # blocks of 32 per scale: 1, or 8 (K-quants)
    scale: np.ndarray  # float32 [N, K / (32 * group)]: A
    offset: np.ndarray | None  # float32 [N, K / (32 * group)]: C; None: no offset term
    offset_mult: np.ndarray | None  # int8 [N, K / 32]: c; None: 1 (only where offset is not None)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def kind_key(self) -> tuple:
        """What must agree for two tensors' rows to be packed together (fused projections)."""
        return (self.signed, self.bits, self.zero, self.sub, self.sub_scales is None, self.group,
                self.offset is None, self.offset_mult is None, self.codes.shape[1])


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float32 [...] (exact)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[B, half] bytes -> [B, 2 * half] codes: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> dict:
    return dict(codes=_nibbles(blocks[:, 2:], 16), scale=_f16(blocks[:, 0:2]), zero=8, bits=4)


def _q4_1(blocks: np.ndarray) -> dict:
    return dict(codes=_nibbles(blocks[:, 4:], 16), scale=_f16(blocks[:, 0:2]), offset=_f16(blocks[:, 2:4]), bits=4)


def _q5_0(blocks: np.ndarray) -> dict:
    high = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # [B, 1]
    high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [B, 32]
    return dict(codes=_nibbles(blocks[:, 6:], 16) | (high << 4), scale=_f16(blocks[:, 0:2]), zero=16, bits=5)


def _q8_0(blocks: np.ndarray) -> dict:
    return dict(codes=blocks[:, 2:].copy(), scale=_f16(blocks[:, 0:2]), signed=True, bits=8)


def _q4_k(blocks: np.ndarray) -> dict:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    packed = blocks[:, 4:16].reshape(n, 3, 4)  # the 6-bit scales and minimums of the 8 sub-blocks
    a, b, c = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)  # [B, 8]
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)  # [B, 8]
    qs = blocks[:, 16:].reshape(n, 4, 32)  # 4 chunks: low nibbles = sub-block 2i, high = 2i + 1
    codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, _QK_K)
    return dict(codes=codes, scale=d, offset=-dmin, offset_mult=mins.astype(np.int8), sub=32,
                sub_scales=sc.astype(np.int8), group=8, bits=4)


def _q6_k(blocks: np.ndarray) -> dict:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 1, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
    low = ((ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(n, 2, 4, 32)
    codes = (low | (high << 4)).reshape(n, _QK_K)
    return dict(codes=codes, scale=_f16(blocks[:, 208:210]), zero=32, sub=16,
                sub_scales=blocks[:, 192:208].view(np.int8).copy(), group=8, bits=6)


# type -> (weights per block, bytes per block, reader)
_TYPES = {"Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q8_0": (32, 34, _q8_0),
          "Q4_K": (256, 144, _q4_k), "Q6_K": (256, 210, _q6_k)}


def decode_blocks(qtype: str, data: np.ndarray, n: int, k: int) -> BlockTensor:
    """The raw bytes of an [N, K] tensor of GGUF type ``qtype`` (as ``GGUFReader`` gives them) -> BlockTensor."""
    if qtype not in _TYPES:
        raise GGUFBlockError(f"GGUF block type {qtype} is not supported as it is (supported: "
                             f"{', '.join(SUPPORTED_TYPES)}); use --weights bf16 or int8 for this file")
    per_block, nbytes, reader = _TYPES[qtype]
    if k % per_block:
        raise GGUFBlockError(f"a {qtype} tensor needs K a multiple of {per_block}, got [{n}, {k}]")
    raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n * (k // per_block), nbytes)
    parts = reader(raw)
    group = parts.get("group", 1)

    def per_row(values: np.ndarray | None, width: int) -> np.ndarray | None:
        return None if values is None else np.ascontiguousarray(values).reshape(n, width)

    sub = parts.get("sub", 32)
    return BlockTensor(
        qtype=qtype, codes=per_row(parts["codes"], k), signed=parts.get("signed", False), bits=parts["bits"],
        zero=parts.get("zero", 0), sub=sub, sub_scales=per_row(parts.get("sub_scales"), k // sub), group=group,
        scale=per_row(parts["scale"], k // (BLOCK * group)), offset=per_row(parts.get("offset"), k // (BLOCK * group)),
        offset_mult=per_row(parts.get("offset_mult"), k // BLOCK))


def integer_weights(t: BlockTensor) -> np.ndarray:
    """``s * (u - zero)`` as int32 [N, K] (exact)."""
    w = _centered_codes(t)
    if t.sub_scales is not None:
        w *= np.repeat(t.sub_scales.astype(np.int32), t.sub, axis=1)
    return w


def _centered_codes(t: BlockTensor) -> np.ndarray:
    """``u - zero`` as int32 [N, K]."""
    u = t.codes.view(np.int8) if t.signed else t.codes
    return u.astype(np.int32) - t.zero


def dequantize(t: BlockTensor) -> np.ndarray:
    """float32 [N, K]: ``(A * s) * (u - zero) + C * c``, equal to ``gguf.quants.dequantize`` bit for bit (signed
    zeros included: the products are grouped as gguf groups them; ``A * s`` is exact)."""
    per_scale = BLOCK * t.group
    a = np.repeat(t.scale, per_scale, axis=1)  # [N, K]
    if t.sub_scales is not None:
        a = a * np.repeat(t.sub_scales.astype(np.float32), t.sub, axis=1)
    w = a * _centered_codes(t).astype(np.float32)
    if t.offset is not None:
        mult = np.float32(1) if t.offset_mult is None else np.repeat(t.offset_mult.astype(np.float32), BLOCK, axis=1)
        w = w + np.repeat(t.offset, per_scale, axis=1) * mult
    return w


def _rows(values: np.ndarray | None, index) -> np.ndarray | None:
    return None if values is None else np.ascontiguousarray(values[index])


def take_rows(t: BlockTensor, index: np.ndarray) -> BlockTensor:
    """The rows ``index`` of ``t`` (a permutation or a selection: blocks never cross rows, so this is exact)."""
    return BlockTensor(t.qtype, _rows(t.codes, index), t.signed, t.bits, t.zero, t.sub, _rows(t.sub_scales, index),
                       t.group, _rows(t.scale, index), _rows(t.offset, index), _rows(t.offset_mult, index))


def concat_rows(parts: list[BlockTensor]) -> BlockTensor:
    """The rows of several tensors of the same kind (:meth:`BlockTensor.kind_key`) one after the other."""
    first = parts[0]
    if any(p.kind_key() != first.kind_key() for p in parts):
        raise GGUFBlockError("cannot concatenate block tensors of different kinds")

    def cat(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else np.concatenate(values, axis=0)

    qtype = first.qtype if all(p.qtype == first.qtype for p in parts) else "+".join(p.qtype for p in parts)
    return BlockTensor(qtype, cat("codes"), first.signed, first.bits, first.zero, first.sub, cat("sub_scales"),
                       first.group, cat("scale"), cat("offset"), cat("offset_mult"))


# where each type keeps its fp16 fields (byte offsets in a block)
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_raw(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw bytes of an [N, K] tensor of ``qtype`` with random codes, scales and minimums (for tests and
    self-checks): uint8 [N * K / block, bytes per block], random bytes with finite fp16 values in the fp16 fields."""
    per_block, nbytes, _ = _TYPES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * (k // per_block), nbytes), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        values = (rng.standard_normal(raw.shape[0]) * 0.01).astype(np.float16)
        raw[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> BlockTensor:
    """:func:`random_raw` decoded."""
    return decode_blocks(qtype, random_raw(qtype, n, k, seed), n, k)
