"""Compile the JIT kernels ahead of the first generation: ``dflash2 kernels build`` (run by ``make models``).

A kernel is otherwise compiled inside the first forward that needs it (15-60 s each on 2 cores), which made the
first run after set-up minutes slower than the second. Building one here is the same call the forward makes (its
``*_available()``, :func:`dflash2.kernels.jit.jit_load`), so the build lands where the forward loads it from; a
kernel this CPU cannot run (AMX on a CPU without it) reports why and builds nothing.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class KernelBuild:
    name: str  # what it is, e.g. "bf16 linear (AVX512-BF16)"
    module: str  # the kernel module
    available: str  # its function that builds, loads and self-checks the kernel (True when usable)
    status: str  # its function giving one line: where it was loaded from, or why not
    args: tuple = ()
    default_path: bool = True  # used by `dflash2 generate` with its defaults (bf16 target, auto drafter)

    def build(self) -> tuple[bool, str]:
        """Build or load it (as the forward would); (usable, one-line status)."""
        module = importlib.import_module(self.module)
        args = self.args or _default_args(self)
        usable = bool(getattr(module, self.available)(*args))
        return usable, str(getattr(module, self.status)(*args))


def _default_args(kernel: KernelBuild) -> tuple:
    """The gguf kernel of the default path is the backend this CPU runs (the PARD drafter's Q8_0 blocks)."""
    if kernel.module != GGUF_MODULE:
        return ()
    from dflash2.kernels.gguf_linear import TORCH, gguf_backend

    backend = gguf_backend()
    return () if backend == TORCH else (backend,)


GGUF_MODULE = "dflash2.kernels.gguf_linear"
KERNELS: tuple[KernelBuild, ...] = (
    KernelBuild("bf16 linear (AVX2/AVX-512)", "dflash2.kernels.packed_linear", "kernels_available", "kernel_status"),
    KernelBuild("bf16 linear (AVX512-BF16)", "dflash2.kernels.dpbf16", "dpbf16_available", "dpbf16_status"),
    KernelBuild("bf16 linear (AMX)", "dflash2.kernels.amx", "amx_available", "amx_status"),
    KernelBuild("layer ops (norm, RoPE, SiLU)", "dflash2.kernels.layer_ops", "layer_ops_available",
                "layer_ops_status"),
    KernelBuild("attention", "dflash2.kernels.attention", "attention_kernel_available", "attention_kernel_status"),
    # the default drafter (PARD) runs in Q8_0 blocks under a bf16 target, on the fastest gguf backend here
    KernelBuild("gguf blocks (PARD drafter, --weights gguf)", GGUF_MODULE, "gguf_kernels_available",
                "gguf_kernel_status"),
    KernelBuild("int8/int4 linear (--weights int8|int4)", "dflash2.kernels.quant_linear", "quant_kernels_available",
                "quant_kernel_status", default_path=False),
    *(KernelBuild(f"gguf blocks {backend} (--weights gguf)", GGUF_MODULE, "gguf_kernels_available",
                  "gguf_kernel_status", (backend,), default_path=False)
      for backend in ("avx2", "avx512-vnni", "amx-int8")),
)


def build_kernels(everything: bool = False) -> Iterator[tuple[str, bool, str]]:
    """Build (or find built) the kernels of the default path (``everything``: of every ``--weights`` too); yields
    (name, usable, one-line status) per kernel as it is done."""
    for kernel in KERNELS:
        if kernel.default_path or everything:
            yield (kernel.name, *kernel.build())
