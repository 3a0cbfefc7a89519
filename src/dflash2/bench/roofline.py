"""The memory-bandwidth roofline of decoding: bytes of weights one token reads, and what this machine can read.

Batch-1 decoding reads every weight once per target pass, so tokens/s <= bandwidth / bytes per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, in seconds (on a shared machine slow moments only lengthen
    the other calls)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """GB/s reading a large fp32 buffer with all threads (a vectorised reduction reads every byte once).

    fp32, not bf16: on CPUs without native bf16 a bf16 reduction is compute-bound and would understate it.
    """
    buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return buffer.numel() * 4 / best_seconds(buffer.sum, repeats) / 1e9


def weight_bytes_per_token(config, bytes_per_weight: int = 2) -> int:
    """Bytes of weights one decode step reads: every projection and the head, one embedding row, the norms."""
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = (config.hidden_size * (q_width + 2 * kv_width) + q_width * config.hidden_size
                 + 3 * config.hidden_size * config.intermediate_size + 2 * config.hidden_size)
    head = config.vocab_size * config.hidden_size
    return bytes_per_weight * (config.num_layers * per_layer + head + 2 * config.hidden_size)


def gguf_bytes_per_token(path: str | Path) -> tuple[int, dict[str, int]]:
    """Bytes one decode step reads from a GGUF file's tensors (all of them, but one row of the token embedding),
    and the count of tensors per quantization type."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    total, types = 0, {}
    for tensor in reader.tensors:
        n_bytes = int(tensor.n_bytes)
        if tensor.name == "token_embd.weight":
            n_bytes //= int(tensor.shape[-1])  # one row of [hidden, vocab]
        total += n_bytes
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return total, types
