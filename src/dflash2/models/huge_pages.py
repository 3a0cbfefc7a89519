"""Copies of large read-only CPU tensors in one buffer backed by transparent huge pages (Linux).

Decoding streams every weight once per step; with 4 KiB pages that is a TLB miss every 4 KiB, and a tensor read
from a safetensors file is a view of the file's memory map, which the kernel backs with 4 KiB page-cache pages.
Copying the weights into one anonymous buffer advised ``MADV_HUGEPAGE`` before its first touch gives them 2 MiB
pages where the kernel's transparent huge pages are ``always`` or ``madvise`` (measured on Zen 4 with the gguf
target: a one-row step 43.0 -> 35.5 ms, interleaved; docs/kernels.md). Elsewhere, or when Linux refuses the advice,
the copies are plain ones: the values are the same either way, only the pages differ.

Faulting huge pages in is not always cheap: in the Firecracker VMs of the Intel Xeon (AMX) a fresh 2 MiB
page cost ~8 s per GB (4 KiB pages 0.2 s), so moving the 1.5B target and the pard drafter took ~25 s of a 40 s
``dflash2 generate``, for no measured gain in decoding there (bf16 and gguf one-row forwards the same within
noise). Nor is it steady: on the AMD EPYC Zen 4 VM a first layer's buffer can fault in fast (pages the guest had
freed) and the next ones at ~10 s per GB (16 s to move the 1.5B target). So by default (``DFLASH2_HUGE_PAGES``
unset or ``auto``) every buffer's fault-in is timed and, once one is slower than
:data:`SLOW_FAULT_SECONDS_PER_GB`, nothing more moves in this process, and a record in the store
(:func:`slow_record`, keyed by the boot) keeps the later processes of this boot from paying for the measurement
again; ``on`` moves everything whatever it costs, ``off`` nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from dflash2 import platform
from dflash2.atomic import write_text_atomic

__all__ = ["ENV", "HUGE_PAGE", "SLOW_FAULT_SECONDS_PER_GB", "huge_page_copies", "huge_pages_mode",
           "move_linear_weights", "slow_record"]

log = logging.getLogger(__name__)

ENV = "DFLASH2_HUGE_PAGES"  # "off": leave the weights where loading put them; "on": always move; "auto" (default)
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
SLOW_FAULT_SECONDS_PER_GB = 1.0  # fault-in slower than this: stop moving (fast machines ~0.1; the slow VMs ~8)
_PROBE_BYTES = 8 << 20  # a buffer at least this large times its fault-in (smaller ones are noise)
_ALIGN = 64  # bytes between tensors in the buffer: every dtype's alignment, a cache line
_MADV_HUGEPAGE = 14
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")  # Linux: a new id at every boot


@dataclasses.dataclass
class _FaultProbe:
    """How fast huge pages fault in here (auto mode): the slowest buffer this process timed, or what the store's
    record of this boot says (read once, ``recalled``); and whether it was reported."""

    seconds_per_gb: float | None = None
    told: bool = False
    recalled: bool = False


_probe = _FaultProbe()


def huge_page_copies(tensors: Sequence[torch.Tensor], measure: bool = False) -> list[torch.Tensor]:
    """Copies of contiguous CPU ``tensors`` (same dtypes and shapes) laid out one after another in one buffer.
    ``measure``: fault the buffer in first and record its seconds per GB (when it is large enough to tell)."""
    offsets, total = [], 0
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("huge_page_copies takes contiguous CPU tensors")
        total = -(-total // _ALIGN) * _ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    buffer = _huge_buffer(total)
    if measure and total >= _PROBE_BYTES:
        start = time.perf_counter()
        buffer.zero_()  # the page faults alone (the source may still be on disk: not timed)
        _measured((time.perf_counter() - start) / (total / 1e9))
    copies = []
    for t, offset in zip(tensors, offsets):
        size = t.numel() * t.element_size()
        copy = buffer[offset : offset + size].view(t.dtype).view(t.shape)
        copies.append(copy.copy_(t))
    return copies


def huge_pages_mode() -> str:
    """``DFLASH2_HUGE_PAGES`` (parsed once, :func:`dflash2.platform.settings`): ``"off"`` (the package's off values,
    :data:`dflash2.platform.OFF_VALUES`), ``"on"``, or ``"auto"`` (unset)."""
    profile = platform.settings()
    profile.check(ENV)
    return profile.huge_pages


def _measured(seconds_per_gb: float) -> None:
    """Keep the slowest fault-in timed; a slow one is recorded for the later processes of this boot."""
    if _probe.seconds_per_gb is None or seconds_per_gb > _probe.seconds_per_gb:
        _probe.seconds_per_gb = seconds_per_gb
    if seconds_per_gb > SLOW_FAULT_SECONDS_PER_GB:
        _write_slow_record(seconds_per_gb)


def _too_slow() -> bool:
    """True once huge pages were measured faulting in slower than SLOW_FAULT_SECONDS_PER_GB, in this process or
    (the store's record) in an earlier one of this boot (said once)."""
    if _probe.seconds_per_gb is None and not _probe.recalled:
        _probe.recalled = True
        _probe.seconds_per_gb = _read_slow_record()
    if _probe.seconds_per_gb is None or _probe.seconds_per_gb <= SLOW_FAULT_SECONDS_PER_GB:
        return False
    if not _probe.told:
        _probe.told = True
        log.info("huge pages fault in at %.1f s per GB here (a VM that backs them slowly): the remaining weights "
                 "stay on 4 KiB pages (%s=on moves them anyway)", _probe.seconds_per_gb, ENV)
    return True


def slow_record() -> Path:
    """The store's record that huge pages faulted in slowly on this machine: the boot's id and the seconds per GB
    measured (a new boot, whose memory the host may back otherwise, measures again; ``rm`` it to measure now)."""
    return platform.settings().home / "huge-pages-slow"


def _boot_id() -> str | None:
    try:
        return _BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def _read_slow_record() -> float | None:
    """The seconds per GB recorded in this boot, or None (no record, another boot's, unreadable)."""
    boot = _boot_id()
    try:
        recorded_boot, seconds = slow_record().read_text().split()
        return float(seconds) if boot is not None and recorded_boot == boot else None
    except (OSError, ValueError):
        return None


def _write_slow_record(seconds_per_gb: float) -> None:
    """Written atomically; where there is no boot id or the store cannot be written, every process measures."""
    boot = _boot_id()
    if boot is None:
        return
    record = slow_record()
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, f"{boot} {seconds_per_gb:.3f}\n")
    except OSError as e:
        log.debug("huge-page record %s not written: %s", record, e)


def move_linear_weights(model: torch.nn.Module) -> int:
    """Move the weights of ``model``'s CPU linear layers onto huge pages, one decoder layer (then the head) per
    buffer, so the load's peak grows by one layer's weights, not the model's: the packed / quantized tensors
    (``weight_data`` / ``scale_data``) of packed bf16 and int8 / int4 layers, and the blocks of GGUF layers. Nothing
    moves when :func:`huge_pages_mode` is off; in auto mode nothing more once a fault-in measured slow (each
    buffer's is timed; one measured in an earlier process of this boot counts). Returns how many buffers (decoder
    layers, the head) moved."""
    mode = huge_pages_mode()
    if mode == "off":
        return 0
    moved = 0
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
        if mode == "auto" and _too_slow():
            break
        copies = iter(huge_page_copies(tensors, measure=mode == "auto"))
        for m, name in slots:
            setattr(m, name, next(copies))
        for m, i, p in blocks:  # a GGUF layer's runs of blocks: the same blocks, new tensors
            m.parts[i] = dataclasses.replace(p, **{name: next(copies) for name in p.tensors()})
            m._weights = None  # its C++ view of the old tensors, rebuilt at the next forward
        moved += 1
    model.__dict__.pop("_gguf_layers", None)  # the one-call layers' views too (kernels/gguf_layer.py)
    return moved


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
