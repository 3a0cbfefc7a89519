"""Float weights quantized to GGUF block types (Q8_0, Q4_0): for weights no GGUF file holds, e.g. the merged pard
drafter (``q8_0`` / ``q4_0``). The result is a :class:`~dflash2.kernels.gguf_blocks.BlockTensor`, run by the same
kernels as a file's own blocks.

Kept apart from :mod:`dflash2.kernels.gguf_blocks`, whose source keys the model store's cache of packed GGUF layers
(:func:`dflash2.models.gguf_cache.layout_tag`): changing how float weights are quantized does not re-decode files.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2.kernels.gguf_blocks import BLOCK, BlockTensor, GGUFBlockError

__all__ = ["quantize_q4_0", "quantize_q8_0"]

_QUANTIZE_ELEMENTS = 1 << 18  # weights per chunk when quantizing (its fp32 temporaries, ~1 MB each, stay in cache)


def _float_blocks(weight: np.ndarray | torch.Tensor, qtype: str) -> torch.Tensor:
    """[N, K / 32, 32] view of a float [N, K] weight (numpy or CPU torch, in its own dtype: each chunk is widened
    to fp32 on its own, exactly), K a multiple of 32."""
    w = torch.as_tensor(weight).detach().to("cpu").contiguous()
    if not w.is_floating_point():
        raise GGUFBlockError(f"{qtype} quantizes a float weight, got {w.dtype}")
    n, k = w.shape
    if k % BLOCK:
        raise GGUFBlockError(f"{qtype} needs K a multiple of {BLOCK}, got [{n}, {k}]")
    return w.view(n, k // BLOCK, BLOCK)


def _fp16_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 values rounded to fp16 (to nearest even; numpy's astype rounds the same) and widened back."""
    return x.to(torch.float16).to(torch.float32)


def _by_row_chunks(blocks: torch.Tensor, dtype: torch.dtype, chunk) -> tuple[np.ndarray, np.ndarray]:
    """(codes [N, K] in dtype, scales fp32 [N, K / 32]) as numpy arrays: ``chunk(part) -> (codes, scales)`` over
    fp32 [rows, K / 32, 32] chunks of ``blocks`` (bounds the temporaries to a chunk's; every operation is per block
    of 32, so the chunking does not change a bit)."""
    n, nb, _ = blocks.shape
    codes = torch.empty(n, nb, BLOCK, dtype=dtype)
    scale = torch.empty(n, nb, dtype=torch.float32)
    rows = max(1, _QUANTIZE_ELEMENTS // (nb * BLOCK))
    for r0 in range(0, n, rows):
        codes[r0 : r0 + rows], scale[r0 : r0 + rows] = chunk(blocks[r0 : r0 + rows].float())
    return codes.view(n, nb * BLOCK).numpy(), scale.numpy()


def _q4_0_chunk(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    largest = part.gather(2, part.abs().argmax(dim=2, keepdim=True))[..., 0]  # [rows, B]: the first largest
    d = _fp16_rounded(largest / -8)
    safe = torch.where(d != 0, d, 1.0)
    q = torch.clamp(torch.round(part / safe[..., None]) + 8, 0, 15)
    return torch.where(d[..., None] != 0, q, 8).to(torch.uint8), d


def _q8_0_chunk(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = _fp16_rounded(part.abs().amax(dim=2) / 127)  # [rows, B]
    safe = torch.where(d > 0, d, 1.0)
    q = torch.clamp(torch.round(part / safe[..., None]), -127, 127)
    return torch.where(d[..., None] > 0, q, 0).to(torch.int8), d


def quantize_q4_0(weight: np.ndarray | torch.Tensor) -> BlockTensor:
    """A float [N, K] weight (K a multiple of 32) as Q4_0 blocks: per 32 inputs ``d = fp16(m / -8)``, m the input
    of largest magnitude (the first such; it maps to code 0, so the other side keeps 7 steps), and codes
    ``round(w / d) + 8`` (half to even) clamped to [0, 15]; 4.5 bits per weight. For weights no GGUF holds (a merged
    drafter). fp32 operations in PyTorch, a chunk of rows at a time (the 0.5B drafter: seconds, not tens)."""
    codes, scale = _by_row_chunks(_float_blocks(weight, "Q4_0"), torch.uint8, _q4_0_chunk)
    return BlockTensor("Q4_0", codes, False, 4, 8, BLOCK, None, 1, scale, None, None)


def quantize_q8_0(weight: np.ndarray | torch.Tensor) -> BlockTensor:
    """A float [N, K] weight (K a multiple of 32) as Q8_0 blocks: per 32 inputs ``d = fp16(amax / 127)`` and codes
    ``round(w / d)`` (half to even) clamped to [-127, 127], 0 where the block is 0 (the format llama.cpp's Q8_0
    stores; codes rounded against the stored fp16 scale). For weights no GGUF holds, e.g. a merged drafter. fp32
    operations in PyTorch, a chunk of rows at a time."""
    codes, scale = _by_row_chunks(_float_blocks(weight, "Q8_0"), torch.int8, _q8_0_chunk)
    return BlockTensor("Q8_0", codes.view(np.uint8), True, 8, 0, BLOCK, None, 1, scale, None, None)
