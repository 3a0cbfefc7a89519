"""OpenMP worker pools across Python threads.

libgomp (PyTorch's OpenMP runtime on Linux) keeps a pool of worker threads for each thread that has opened a
parallel region. When it manages more threads than the process may run on (on 2 cores: the pool of the thread
that loaded the models and the pool of the batch engine's loop thread), it throttles the idle workers' spin-wait
to almost nothing, and every parallel region then waits for a sleeping worker to wake up. Measured on 2 cores of
an Intel Xeon (AMX), one 16-row product per call (`/work`-local script, 50 calls each, docs/serving.md,
2026-12-05): Q8_0 [4864, 896] 0.29 ms on the main thread against 0.51 ms on a second thread, bf16 AMX
[8960, 1536] 0.55 against 0.65 ms; with the main thread's pool released first, 0.25 and 0.56 ms. So a thread that
hands all parallel work to another (the server's main thread, once the models are loaded) releases its pool.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the runtime's threads, keep what can be kept


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (``omp_pause_resource_all(omp_pause_soft)``; libgomp frees the
    pool of the calling thread only), so that another thread that runs the parallel work from now on owns the only
    pool. True when released; False where PyTorch does not run on libgomp (another OpenMP runtime, or none) or the
    runtime refused (the caller is inside a parallel region). The pool comes back if this thread runs a parallel
    region again: only speed depends on it, never a result."""
    runtime = _libgomp()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@functools.cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp this process has loaded (PyTorch's), or None."""
    importlib.import_module("torch")  # loads PyTorch's OpenMP runtime

    maps = Path("/proc/self/maps")
    if not maps.exists():  # not Linux: no libgomp to find this way
        return None
    paths = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line.rsplit("/", 1)[-1]}
    for path in sorted(paths):
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
            runtime.omp_pause_resource_all.restype = ctypes.c_int
            return runtime
        except (OSError, AttributeError):  # not loadable, or too old for OpenMP 5.0's pause
            continue
    return None
