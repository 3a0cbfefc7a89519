"""huge_page_copies: the same values, dtypes and shapes, in one buffer that starts on a huge-page boundary."""

from __future__ import annotations

import pytest
import torch

from dflash2.models.huge_pages import HUGE_PAGE, huge_page_copies


def test_copies_are_equal_and_share_one_aligned_buffer():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(700, 900, generator=g), torch.arange(7, dtype=torch.int8),
               torch.randn(3, 5, generator=g).bfloat16(), torch.randint(0, 255, (4, 3, 32), dtype=torch.uint8)]
    copies = huge_page_copies(tensors)
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() and c.data_ptr() % 64 == 0
    storages = {c.untyped_storage().data_ptr() for c in copies}
    assert len(storages) == 1  # one buffer
    assert copies[0].data_ptr() % HUGE_PAGE == 0
    tensors[0][0, 0] = 1e9  # copies, not views
    assert copies[0][0, 0] != 1e9


def test_refuses_non_contiguous_tensors():
    with pytest.raises(ValueError, match="contiguous CPU"):
        huge_page_copies([torch.randn(4, 6).T])
