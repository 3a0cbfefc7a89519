"""The packed layout of a GGUF file's quantized blocks for the AVX2 kernel (``gemm_gguf_avx2.cpp`` describes it) and
its exact inverse. Its own module because the model store's cache of packed layers is keyed by a hash of the code
that decides the cached bytes (``models/gguf_cache.py``): the kernel's wrapper can change without invalidating it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash2.kernels.gguf_blocks import BLOCK, BlockTensor

PANEL = 8  # outputs per packed panel (kPanel in gemm_gguf_avx2.cpp)


@dataclass(frozen=True)
class PackedBlocks:
    """One run of rows of the same kind in the kernel layout (see gemm_gguf_avx2.cpp); P = ceil(N / 8)."""

    weight: torch.Tensor  # uint8 [P, B, 4 + bits - 4, 32] (nibbles, then high-bit planes) or [P, B, 8, 32] (Q8_0)
    scale: torch.Tensor  # fp32 [P, B/group, 8]
    offset: torch.Tensor | None  # fp32 [P, B/group, 8]
    sub_scales: torch.Tensor | None  # int8 [P, B, 32/sub, 8]
    offset_mult: torch.Tensor | None  # int8 [P, B, 8]
    bits: int
    signed: bool
    zero: int
    sub: int
    group: int
    out_features: int
    qtype: str

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by name (absent ones left out): what the model store's cache holds."""
        parts = {"weight": self.weight, "scale": self.scale, "offset": self.offset, "sub_scales": self.sub_scales,
                 "offset_mult": self.offset_mult}
        return {name: t for name, t in parts.items() if t is not None}

    def meta(self) -> dict[str, object]:
        return {"bits": self.bits, "signed": self.signed, "zero": self.zero, "sub": self.sub, "group": self.group,
                "out_features": self.out_features, "qtype": self.qtype}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


# ------------------------------------------------------------------------------------------------ packing


def _panels(values: np.ndarray, p: int) -> np.ndarray:
    """[N, ...] -> [P * 8, ...] padded with zeros."""
    pad = p * PANEL - values.shape[0]
    return values if pad == 0 else np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])


def _per_panel(values: np.ndarray | None, p: int, dtype) -> torch.Tensor | None:
    """[N, X] -> [P, X, 8] (output innermost)."""
    if values is None:
        return None
    padded = _panels(values, p).reshape(p, PANEL, -1).transpose(0, 2, 1)
    return torch.from_numpy(np.ascontiguousarray(padded, dtype=dtype))


def pack_blocks(t: BlockTensor) -> PackedBlocks:
    """The kernel layout of ``t`` (exact; :func:`unpack_blocks` inverts it)."""
    n, k = t.shape
    p, b = -(-n // PANEL), k // BLOCK
    steps = _steps(_panels(t.codes, p), p, b)  # [P, B, t, 32]
    if t.signed:
        weight = steps
    else:
        nib = (steps[:, :, :4] & 0x0F) | ((steps[:, :, 4:] & 0x0F) << 4)  # [P, B, 4, 32]
        weight = np.concatenate([nib, _high_planes(steps >> 4, t.bits - 4)], axis=2)
    sub_scales = None
    if t.sub_scales is not None:
        h = BLOCK // t.sub
        sub_scales = _per_panel(t.sub_scales, p, np.int8).reshape(p, b, h, PANEL)
    return PackedBlocks(
        weight=torch.from_numpy(np.ascontiguousarray(weight, dtype=np.uint8)),
        scale=_per_panel(t.scale, p, np.float32), offset=_per_panel(t.offset, p, np.float32),
        sub_scales=sub_scales, offset_mult=_per_panel(t.offset_mult, p, np.int8),
        bits=t.bits, signed=t.signed, zero=t.zero, sub=t.sub, group=t.group, out_features=n, qtype=t.qtype)


def _steps(codes: np.ndarray, p: int, b: int) -> np.ndarray:
    """[P * 8, K] codes -> [P, B, 8 steps, 32]: step t of block b holds inputs 4t .. 4t + 3 of the panel's 8 outputs,
    each output's 4 bytes moved as one 4-byte word (a quarter of the elements to permute: 4x faster)."""
    words = np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint32).reshape(p, PANEL, b, 8)
    return words.transpose(0, 2, 3, 1).copy().view(np.uint8).reshape(p, b, 8, 32)


def _high_planes(high: np.ndarray, hb: int) -> np.ndarray:
    """[P, B, 8 steps, 32] high parts (< 2**hb) -> [P, B, hb, 32] planes: step t at plane t*hb // 8, bit t*hb % 8."""
    planes = np.zeros((*high.shape[:2], hb, 32), np.uint8)
    for t in range(8 if hb else 0):
        planes[:, :, t * hb // 8] |= (high[:, :, t] << (t * hb % 8)).astype(np.uint8)
    return planes


def _high_bits(planes: np.ndarray, hb: int) -> np.ndarray:
    """Inverse of :func:`_high_planes` ([P, B, 8, 32]; zeros for hb = 0)."""
    high = np.zeros((*planes.shape[:2], 8, 32), np.uint8)
    for t in range(8 if hb else 0):
        high[:, :, t] = (planes[:, :, t * hb // 8] >> (t * hb % 8)) & ((1 << hb) - 1)
    return high


def _unpanel(values: torch.Tensor | None, n: int) -> np.ndarray | None:
    """[P, X, 8] -> [N, X]."""
    if values is None:
        return None
    return np.ascontiguousarray(values.numpy().transpose(0, 2, 1).reshape(-1, values.shape[1])[:n])


def unpack_blocks(pb: PackedBlocks, rows: slice | None = None) -> BlockTensor:
    """The integer form back from the kernel layout (``rows``: a slice of panels' rows, multiples of 8)."""
    sel = rows or slice(0, pb.out_features)
    p0, p1 = sel.start // PANEL, -(-min(sel.stop, pb.out_features) // PANEL)
    n = min(sel.stop, pb.out_features) - sel.start

    def part(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[p0:p1]

    w = pb.weight[p0:p1].numpy()
    p, b = w.shape[0], w.shape[1]
    if pb.signed:
        steps = w
    else:
        nib = w[:, :, :4]
        steps = np.concatenate([nib & 0x0F, nib >> 4], axis=2) | (_high_bits(w[:, :, 4:], pb.bits - 4) << 4)
    codes = steps.reshape(p, b, 8, PANEL, 4).transpose(0, 3, 1, 2, 4).reshape(p * PANEL, b * 32)
    sub = part(pb.sub_scales)
    sub_np = None if sub is None else _unpanel(sub.reshape(p, -1, PANEL), n)
    return BlockTensor(pb.qtype, np.ascontiguousarray(codes[:n]), pb.signed, pb.bits, pb.zero, pb.sub, sub_np,
                       pb.group, _unpanel(part(pb.scale), n), _unpanel(part(pb.offset), n),
                       _unpanel(part(pb.offset_mult), n))
