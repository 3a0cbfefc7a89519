"""Map the pages of memory-mapped weights into the process ahead of their first use, on another core.

A model read from the store's caches (``models/packed_cache.py``) is a set of views of the cache file's memory map:
reading it costs nothing, but the first forward then takes a page fault for every 64 KiB of weights it streams
(the kernel maps page-cache pages a few at a time). On the AMD EPYC Zen 4 VM that made the 1.5B target's first
prefill 0.4-1.2 s slower than the next one (3 GB, ~47,000 faults), while the load's other steps (the tokenizer, the
drafter, the chat template) kept one core of two busy and the other idle. So after a cache is read, a daemon thread
asks Linux to map those pages (``madvise(MADV_POPULATE_READ)``, Linux 5.14+, ctypes releasing the GIL), in chunks so
that the process's other memory calls never wait long behind it. The values read are the same either way; where
the call is refused (an older kernel, not Linux) the first forward faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import queue
import sys
import threading
from collections.abc import Iterable

import torch

__all__ = ["CHUNK", "prefault", "wait_idle"]

log = logging.getLogger(__name__)

CHUNK = 64 << 20  # bytes per madvise call: the mapping's lock is released between chunks
_PAGE = 4096
_MADV_POPULATE_READ = 22


class _Worker:
    """One daemon thread, started at the first request, populating the requests' ranges in the order they came."""

    def __init__(self) -> None:
        self.requests: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.refused = False  # the kernel refused MADV_POPULATE_READ once: no more requests

    def submit(self, ranges: list[tuple[int, int]], keep: list[torch.Tensor]) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="dflash2-prefault", daemon=True)
                self.thread.start()
        self.requests.put((ranges, keep))

    def run(self) -> None:
        madvise = _madvise()
        while True:
            ranges, keep = self.requests.get()
            try:
                if madvise is not None and not self.refused:
                    self.populate(madvise, ranges)
            finally:
                del keep  # (the tensors were kept alive, their map with them, until their pages were asked for)
                self.requests.task_done()

    def populate(self, madvise, ranges: list[tuple[int, int]]) -> None:
        for start, end in ranges:
            for at in range(start, end, CHUNK):
                if madvise(ctypes.c_void_p(at), ctypes.c_size_t(min(CHUNK, end - at)), _MADV_POPULATE_READ) != 0:
                    errno = ctypes.get_errno()
                    if errno in (22, 38):  # EINVAL / ENOSYS: this kernel has no MADV_POPULATE_READ
                        self.refused = True
                    log.debug("madvise(MADV_POPULATE_READ) refused (errno %d): pages fault in at first use", errno)
                    return


_worker = _Worker()


def page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The 4 KiB-page-aligned address ranges of the CPU ``tensors``' bytes, sorted, overlapping ones merged."""
    spans = sorted((t.data_ptr() // _PAGE * _PAGE, -(-(t.data_ptr() + t.numel() * t.element_size()) // _PAGE) * _PAGE)
                   for t in tensors if t.device.type == "cpu" and t.numel() > 0)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def prefault(tensors: Iterable[torch.Tensor]) -> None:
    """Ask, on the background thread, for the pages of ``tensors`` (views of a file's memory map) to be mapped now.
    Returns at once; the tensors are kept alive until their pages were asked for."""
    if not sys.platform.startswith("linux") or _worker.refused:
        return
    keep = list(tensors)
    ranges = page_ranges(keep)
    if ranges:
        _worker.submit(ranges, keep)


def wait_idle() -> None:
    """Return once every request so far was carried out (tests; nothing needs to wait for it)."""
    if _worker.thread is not None:
        _worker.requests.join()


def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    libc.madvise.restype = ctypes.c_int
    return libc.madvise
