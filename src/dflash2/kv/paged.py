"""A paged KV cache: one pool of fixed-size blocks shared by many sequences under a fixed memory budget.

Each sequence owns a :class:`BlockTable` (its blocks in order, its committed length). Slot ``s`` of a sequence
lives at pool slot ``blocks[s // block_size] * block_size + s % block_size``. Admission reserves the most
blocks a sequence can ever need, so a running sequence never finds the pool empty; blocks are taken from the
pool as the sequence grows and returned when it is rolled back past a block boundary or finishes.
"""

from __future__ import annotations

import torch


class KVBudgetError(RuntimeError):
    """The pool cannot reserve the blocks a sequence asks for (now, or ever when ``never`` is set)."""

    def __init__(self, message: str, never: bool = False) -> None:
        super().__init__(message)
        self.never = never


class PagedKVPool:
    """Keys and values of every layer: ``[num_layers, num_blocks * block_size, num_kv_heads, head_dim]`` each."""

    supports_rollback = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, N_blocks * bs, H_kv, Dh]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, N_blocks * bs, H_kv, Dh]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self.reserved = 0  # blocks promised to live block tables (allocated or not yet)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * element  # keys and values

    @property
    def blocks_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def new_table(self, max_slots: int) -> BlockTable:
        """Reserve the blocks for a sequence of at most ``max_slots`` slots; raises KVBudgetError if they are not
        free now (``never`` set when the request exceeds the whole pool)."""
        need = self.blocks_for(max_slots)
        if need > self.num_blocks:
            raise KVBudgetError(f"a sequence of {max_slots} slots needs {need} KV blocks; the pool has "
                                f"{self.num_blocks}", never=True)
        if self.reserved + need > self.num_blocks:
            raise KVBudgetError(f"KV cache full: {need} blocks needed, {self.num_blocks - self.reserved} unreserved")
        self.reserved += need
        return BlockTable(self, need)

    def _take(self) -> int:
        return self._free.pop()

    def _give_back(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class BlockTable:
    """The blocks of one sequence and its committed length (``length`` slots hold valid keys/values)."""

    def __init__(self, pool: PagedKVPool, reserved_blocks: int) -> None:
        self.pool = pool
        self.reserved_blocks = reserved_blocks
        self.blocks: list[int] = []
        self.length = 0
        self.released = False

    @property
    def capacity(self) -> int:
        return self.reserved_blocks * self.pool.block_size

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Pool slots of this sequence's slots ``[start, end)``, allocating blocks up to ``end``: [end - start]."""
        if self.released:
            raise ValueError("the block table was released")
        if end > self.capacity:
            raise ValueError(f"slot {end} is past the reserved capacity {self.capacity}")
        while len(self.blocks) * self.pool.block_size < end:
            self.blocks.append(self.pool._take())
        return self._pool_slots(torch.arange(start, end))

    def compact(self, source_slots: torch.Tensor, destination: int) -> None:
        """Copy this sequence's slots ``source_slots`` [n] (ascending, >= destination) to ``[destination,
        destination + n)`` in every layer and set ``length`` to its end (the accepted branch of a verified tree
        becomes a chain), as :meth:`StaticKVCache.compact` does."""
        n = int(source_slots.numel())
        source = self._pool_slots(source_slots.to(torch.int64).cpu())  # [n] pool slots
        target = self.slots(destination, destination + n)  # [n]
        device = self.pool.keys.device
        source, target = source.to(device), target.to(device)
        self.pool.keys[:, target] = self.pool.keys.index_select(1, source)
        self.pool.values[:, target] = self.pool.values.index_select(1, source)
        self.rollback(destination + n)

    def _pool_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Pool slots of allocated positions [n] -> [n]."""
        size = self.pool.block_size
        if positions.numel() and int(positions.max()) >= len(self.blocks) * size:
            raise ValueError(f"slot {int(positions.max())} is not allocated")
        blocks = torch.tensor(self.blocks, dtype=torch.int64)
        return blocks[positions // size] * size + positions % size

    def rollback(self, length: int) -> None:
        """Keep slots ``[0, length)``; blocks wholly past ``length`` go back to the pool."""
        if not 0 <= length <= len(self.blocks) * self.pool.block_size:
            raise ValueError(f"cannot set length {length}: {len(self.blocks)} blocks allocated")
        self.length = length
        keep = self.pool.blocks_for(length)
        if keep < len(self.blocks):
            self.pool._give_back(self.blocks[keep:])
            del self.blocks[keep:]

    def release(self) -> None:
        """Return every block and the reservation (idempotent)."""
        if self.released:
            return
        self.pool._give_back(self.blocks)
        self.blocks = []
        self.pool.reserved -= self.reserved_blocks
        self.released = True
