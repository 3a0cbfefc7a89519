"""models/prefault.py: the pages of memory-mapped tensors are mapped on a background thread, so that their first
use takes no page faults; the ranges asked for cover exactly the tensors' pages."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash2.models import prefault as pf


def test_page_ranges_are_aligned_sorted_and_merged():
    buffer = torch.zeros(10 * 4096, dtype=torch.uint8)
    base = buffer.data_ptr()
    first = base // 4096 * 4096
    a, b = buffer[4100:4200], buffer[4200:9000]  # touching: one range
    c = buffer[6 * 4096 + 10 : 7 * 4096 + 1]  # apart, its last byte on the next page
    ranges = pf.page_ranges([c, b, a, torch.empty(0)])
    assert all(start % 4096 == 0 and end % 4096 == 0 for start, end in ranges)
    assert ranges == [((base + 4100) // 4096 * 4096, -(-(base + 9000) // 4096) * 4096),
                      ((base + 6 * 4096 + 10) // 4096 * 4096, -(-(base + 7 * 4096 + 1) // 4096) * 4096)]
    assert ranges[0][0] >= first


def _mapped_kib(tensor: torch.Tensor) -> int:
    """Resident KiB of the mapping that holds ``tensor`` (/proc/self/smaps): what is mapped into the process."""
    at = tensor.data_ptr()
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low <= at < high
        elif inside and fields[0] == "Rss:":
            return int(fields[1])
    raise AssertionError("no mapping holds the tensor")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_READ and smaps are Linux's")
def test_prefault_maps_the_pages_of_a_mapped_tensor(tmp_path):
    path = tmp_path / "w.safetensors"
    values = torch.arange(16 << 20, dtype=torch.int32)  # 64 MiB
    save_file({"w": values}, str(path))
    with safe_open(str(path), framework="pt") as handle:
        mapped = handle.get_tensor("w")  # a view of the file's map, nothing of it read yet
    untouched = _mapped_kib(mapped)
    pf.prefault([mapped])
    pf.wait_idle()
    if pf._worker.refused:
        pytest.skip("this kernel has no MADV_POPULATE_READ")
    assert untouched < 8 << 10
    assert _mapped_kib(mapped) >= 64 << 10  # every page of the tensor mapped, none of it read by this thread
    assert torch.equal(mapped, values)
