"""Copies of large read-only CPU tensors in one buffer backed by transparent huge pages (Linux).

Decoding streams every weight once per step; with 4 KiB pages that is a TLB miss every 4 KiB, and a tensor read
from a safetensors file is a view of the file's memory map, which the kernel backs with 4 KiB page-cache pages.
Copying the weights into one anonymous buffer advised ``MADV_HUGEPAGE`` before its first touch gives them 2 MiB
pages where the kernel's transparent huge pages are ``always`` or ``madvise`` (measured on Zen 4 with the gguf
target: a one-row step 43.0 -> 35.5 ms, interleaved; docs/kernels.md). Elsewhere, or when Linux refuses the advice,
the copies are plain ones: the values are the same either way, only the pages differ.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import sys
from collections.abc import Sequence

import torch

from dflash2.kernels import jit

__all__ = ["ENV", "HUGE_PAGE", "huge_page_copies", "huge_pages_wanted", "move_linear_weights"]

log = logging.getLogger(__name__)

ENV = "DFLASH2_HUGE_PAGES"  # "off": leave the weights where loading put them (for comparisons)
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_ALIGN = 64  # bytes between tensors in the buffer: every dtype's alignment, a cache line
_MADV_HUGEPAGE = 14


def huge_page_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors`` (same dtypes and shapes) laid out one after another in one buffer."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("huge_page_copies takes contiguous CPU tensors")
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buffer = _huge_buffer(total)
    copies = []
    for t, offset in zip(tensors, offsets):
        size = t.numel() * t.element_size()
        copy = buffer[offset : offset + size].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def huge_pages_wanted() -> bool:
    """False when ``DFLASH2_HUGE_PAGES`` is off (read at each load)."""
    return not jit.switched_off(ENV)


def move_linear_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Move the weights of ``model``'s CPU linear layers onto huge pages, one decoder layer (then the head) per
    buffer, so the load's peak grows by one layer's weights, not the model's: the packed / quantized tensors
    (``weight_data`` / ``scale_data``) of packed bf16 and int8 / int4 layers, and the blocks of GGUF layers. Nothing
    moves when :func:`huge_pages_wanted` is false."""
    if not huge_pages_wanted():
        return model
    groups = [list(layer.modules()) for layer in getattr(model, "layers", [])]
    head = getattr(model, "lm_head", None)
    groups.append(list(head.modules()) if head is not None else [])
    for modules in groups:
        slots = [(m, name) for m in modules for name in ("weight_data", "scale_data")
                 if _movable(getattr(m, name, None))]
        blocks = [(m, i, p) for m in modules for i, p in enumerate(_gguf_parts(m))]
        tensors = [getattr(m, name) for m, name in slots] + [t for _, _, p in blocks for t in p.tensors().values()]
        if not tensors:
            continue
        copies = iter(huge_page_copies(tensors))
        for m, name in slots:
            setattr(m, name, next(copies))
        for m, i, p in blocks:  # a GGUF layer's runs of blocks: the same blocks, new tensors
            m.parts[i] = dataclasses.replace(p, **{name: next(copies) for name in p.tensors()})
            m._weights = None  # its C++ view of the old tensors, rebuilt at the next forward
    model.__dict__.pop("_gguf_layers", None)  # the one-call layers' views too (kernels/gguf_layer.py)
    return model


def _movable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and not t.requires_grad


def _gguf_parts(module) -> list:
    from dflash2.kernels.gguf_linear import GgufLinear  # kernels import models: imported when needed

    return list(module.parts) if isinstance(module, GgufLinear) else []


def _huge_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], starting on a huge-page boundary, advised MADV_HUGEPAGE before anything touches it."""
    raw = torch.empty(nbytes + 2 * HUGE_PAGE, dtype=torch.uint8)  # untouched: malloc maps fresh pages
    start = (-raw.data_ptr()) % HUGE_PAGE
    buffer = raw[start : start + nbytes]
    if sys.platform.startswith("linux") and nbytes >= HUGE_PAGE:
        length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # within raw: start + length < nbytes + 2 huge pages
        if _libc().madvise(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) refused (errno %d): 4 KiB pages", ctypes.get_errno())
    return buffer


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc
