"""kernels/threads.py: the calling thread's OpenMP pool is released for a thread that does the parallel work; results
do not depend on it (only speed does)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from dflash2.kernels.threads import _libgomp, release_openmp_pool


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PyTorch runs on libgomp on Linux")
def test_the_pool_is_released_and_products_stay_the_same():
    assert _libgomp() is not None  # PyTorch's CPU wheels ship libgomp on Linux
    x = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    before = x @ x.T  # a parallel region: the main thread's pool exists
    assert release_openmp_pool()
    out: dict[str, torch.Tensor] = {}
    worker = threading.Thread(target=lambda: out.setdefault("product", x @ x.T))
    worker.start()
    worker.join()
    assert torch.equal(out["product"], before) and torch.equal(x @ x.T, before)  # the pool comes back on demand
    assert release_openmp_pool()  # released again (nothing runs in parallel now)
