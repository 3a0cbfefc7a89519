"""A static, position-indexed KV cache: preallocated slots, a length pointer, O(1) rollback.

Slot s holds the keys/values of the s-th token written. For chains slot == position; a verified tree is
written in input order and :meth:`StaticKVCache.compact` moves the accepted branch into consecutive slots.

A cache may also keep, per committed slot, the target's hidden states at the layers a block drafter reads
(``tap_layers``): the single-request engine keeps a finished generation's cache for the next call (prefix reuse),
and a block drafter that starts from a reused prefix reads those positions' hidden states from here.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Keys and values of every layer, ``[num_layers, batch, num_kv_heads, capacity, head_dim]``.

    ``length`` is the number of committed slots. A forward pass writes its T new tokens at
    ``[length, length + T)`` and then :meth:`advance` moves the pointer; :meth:`rollback` moves it back.
    Slots at or after ``length`` are garbage and are overwritten by the next write.
    """

    supports_rollback = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        batch_size: int = 1,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        tap_layers: tuple[int, ...] = (),
        tap_width: int = 0,
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S, Dh]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, S, Dh]
        self.capacity = capacity
        self.length = 0
        self.tap_layers = tuple(tap_layers)
        self.taps = None  # [n_taps, S, D]: hidden states of the committed slots at tap_layers (batch of 1)
        if self.tap_layers:
            if tap_width <= 0 or batch_size != 1:
                raise ValueError(f"kept hidden states need tap_width > 0 and a batch of 1, got {tap_width}, "
                                 f"{batch_size}")
            self.taps = torch.zeros(len(self.tap_layers), capacity, tap_width, dtype=dtype, device=device)

    @staticmethod
    def nbytes_for(num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                   batch_size: int = 1) -> int:
        """Bytes of the keys and values a cache of this shape allocates."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * batch_size * num_kv_heads * capacity * head_dim * element

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + (0 if self.taps is None else self.taps.nbytes)

    def write_taps(self, start: int, taps: tuple[torch.Tensor, ...]) -> None:
        """Keep the hidden states of slots ``[start, start + n)`` (``taps``: per tap layer, [1, n, D]); a no-op
        for a cache that keeps none."""
        if self.taps is None:
            return
        if len(taps) != len(self.tap_layers):
            raise ValueError(f"{len(taps)} tapped layers given, the cache keeps {len(self.tap_layers)}")
        for row, tap in zip(self.taps, taps):
            row[start : start + tap.shape[1]] = tap[0]

    def read_taps(self, end: int) -> tuple[torch.Tensor, ...]:
        """The kept hidden states of slots ``[0, end)``: per tap layer, [1, end, D]."""
        if self.taps is None:
            raise ValueError("this cache keeps no hidden states")
        return tuple(row[None, :end] for row in self.taps)

    def grown(self, capacity: int) -> StaticKVCache:
        """A cache of ``capacity`` slots holding this one's committed slots (this one unchanged)."""
        if capacity <= self.capacity:
            return self
        _, batch, heads, _, head_dim = self.keys.shape
        bigger = StaticKVCache(self.keys.shape[0], heads, head_dim, capacity, batch_size=batch, dtype=self.keys.dtype,
                               device=self.keys.device, tap_layers=self.tap_layers,
                               tap_width=0 if self.taps is None else self.taps.shape[-1])
        n = self.length
        bigger.keys[:, :, :, :n] = self.keys[:, :, :, :n]
        bigger.values[:, :, :, :n] = self.values[:, :, :, :n]
        if self.taps is not None:
            bigger.taps[:, :n] = self.taps[:, :n]
        bigger.length = n
        return bigger

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values [B, H_kv, T, Dh] at ``[length, length + T)`` of one layer.

        Returns views over all slots a query of this pass may see: ``[B, H_kv, length + T, Dh]`` each.
        The length pointer does not move here (every layer writes at the same offset); call :meth:`advance`.
        """
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} slots needed, capacity {self.capacity}")
        self.keys[layer, :, :, self.length : end] = keys
        self.values[layer, :, :, self.length : end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]

    def advance(self, num_tokens: int) -> None:
        self.length += num_tokens

    def rollback(self, length: int) -> None:
        """Forget every slot at or after ``length``: O(1), nothing is copied."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.length} slots")
        self.length = length

    def compact(self, source_slots: torch.Tensor, destination: int) -> None:
        """Copy the slots ``source_slots`` [n] (ascending, >= destination) to ``[destination, destination + n)``.

        Used after tree verification: the accepted branch becomes a contiguous chain. Sets ``length`` to the
        end of the copied range.
        """
        n = int(source_slots.numel())
        index = source_slots.to(self.keys.device)
        self.keys[:, :, :, destination : destination + n] = self.keys.index_select(3, index)
        self.values[:, :, :, destination : destination + n] = self.values.index_select(3, index)
        self.length = destination + n

    def reset(self) -> None:
        self.length = 0
