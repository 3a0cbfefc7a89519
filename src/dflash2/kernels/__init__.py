"""CPU compute kernels (JIT-built C++ with a pure-PyTorch fallback).

    from dflash2.kernels import PackedLinear, kernels_available, kernel_status
    layer = PackedLinear.from_linear(linear)   # bf16-packed weights, AVX2/FMA kernel on CPU
"""

from dflash2.kernels.packed_linear import (
    PackedLinear,
    kernel_status,
    kernels_available,
    pack_weight,
    unpack_weight,
)

__all__ = ["PackedLinear", "kernel_status", "kernels_available", "pack_weight", "unpack_weight"]
