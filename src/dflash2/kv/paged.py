"""A paged KV cache: one pool of fixed-size blocks shared by many sequences under a fixed memory budget.

Each sequence owns a :class:`BlockTable` (its blocks in order, its committed length). Slot ``s`` of a sequence
lives at pool slot ``blocks[s // block_size] * block_size + s % block_size``. Admission reserves the most
blocks a sequence can ever need, so a running sequence never finds the pool empty; blocks are taken from the
pool as the sequence grows and returned when it is rolled back past a block boundary or finishes.

With a prefix cache (``prefix_cache=True``, :mod:`dflash2.kv.prefix_cache`) full committed blocks are registered
under the ids they hold; a new table starts with the longest cached prefix of its prompt (those blocks shared,
reference-counted, never written again) and a block whose last reference goes away stays cached, evictable, until
the free list runs dry. The reservation still counts every block of a table, shared ones included (conservative:
the reservations alone never exceed the pool, so an evictable block is always there when a table grows).
The pool can also keep, per slot, the target's hidden states at the layers a block drafter reads
(``tap_layers``): a request that starts from a cached prefix hands them to its drafter instead of recomputing them.
"""

from __future__ import annotations

import torch

from dflash2.kv.prefix_cache import ROOT, PrefixCache, chain_digest


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
        prefix_cache: bool = False,
        tap_layers: tuple[int, ...] = (),
        tap_width: int = 0,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, N_blocks * bs, H_kv, Dh]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, N_blocks * bs, H_kv, Dh]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest ids are handed out first
        self._refs = [0] * num_blocks  # block tables holding each block
        self.reserved = 0  # blocks promised to live block tables (allocated or not yet, shared ones included)
        self.cache = PrefixCache(block_size) if prefix_cache else None
        self.tap_layers = tuple(tap_layers) if prefix_cache else ()
        self.taps = None  # [n_taps, N_blocks * bs, D]: tapped hidden states of every slot (prefix cache only)
        if self.tap_layers:
            if tap_width <= 0:
                raise ValueError(f"tap_width must be > 0 with tap layers, got {tap_width}")
            self.taps = torch.zeros(len(self.tap_layers), num_blocks * block_size, tap_width, dtype=dtype,
                                    device=device)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                        tap_width: int = 0) -> int:
        """Keys and values of one block, plus ``tap_width`` (tapped layers x hidden size) values per slot."""
        element = torch.empty((), dtype=dtype).element_size()
        return (2 * num_layers * num_kv_heads * head_dim + tap_width) * block_size * element

    @property
    def blocks_used(self) -> int:
        """Blocks live tables hold (cached blocks nobody holds are not counted: they can be handed out)."""
        return self.num_blocks - len(self._free) - self.blocks_evictable

    @property
    def blocks_evictable(self) -> int:
        return 0 if self.cache is None else self.cache.num_evictable

    @property
    def blocks_cached(self) -> int:
        """Blocks registered in the prefix cache (held by a table or evictable)."""
        return 0 if self.cache is None else self.cache.num_cached

    def blocks_for(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def new_table(self, max_slots: int, prompt_ids: list[int] | None = None) -> BlockTable:
        """Reserve the blocks for a sequence of at most ``max_slots`` slots; raises KVBudgetError if they are not
        free now (``never`` set when the request exceeds the whole pool). With a prefix cache and ``prompt_ids``,
        the table starts with the longest cached prefix of ``prompt_ids[:-1]`` (full blocks; at least the last
        prompt id is left to feed, whose logits start the answer): ``table.length`` slots are already there."""
        need = self.blocks_for(max_slots)
        if need > self.num_blocks:
            raise KVBudgetError(f"a sequence of {max_slots} slots needs {need} KV blocks; the pool has "
                                f"{self.num_blocks}", never=True)
        if self.reserved + need > self.num_blocks:
            raise KVBudgetError(f"KV cache full: {need} blocks needed, {self.num_blocks - self.reserved} unreserved")
        self.reserved += need
        table = BlockTable(self, need)
        if self.cache is not None and prompt_ids:
            hit = self.cache.match(prompt_ids[: min(len(prompt_ids) - 1, max_slots)])
            for block in hit.blocks:
                self._share(block)
            table.blocks, table.digests = list(hit.blocks), list(hit.digests)
            table.length = table.cached_tokens = len(hit.blocks) * self.block_size
            self.cache.count_lookup(len(prompt_ids), table.cached_tokens)
        return table

    def _take(self) -> int:
        block = self._free.pop() if self._free else self.cache.evict() if self.cache is not None else None
        if block is None:
            raise RuntimeError("the KV pool is empty: the reservations should have prevented this")
        self._refs[block] = 1
        return block

    def _share(self, block: int) -> None:
        if self._refs[block] == 0:
            self.cache.unpark(block)
        self._refs[block] += 1

    def _give_back(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks become evictable (the last block of a
        sequence first, so a prefix outlives its extensions), the others free."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if self.cache is not None and self.cache.holds(block):
                self.cache.park(block)
            else:
                self._free.append(block)


class BlockTable:
    """The blocks of one sequence and its committed length (``length`` slots hold valid keys/values)."""

    def __init__(self, pool: PagedKVPool, reserved_blocks: int) -> None:
        self.pool = pool
        self.reserved_blocks = reserved_blocks
        self.blocks: list[int] = []
        self.length = 0
        self.released = False
        self.digests: list[bytes] = []  # prefix-cache keys of the leading full blocks (shared or registered)
        self.cached_tokens = 0  # slots found in the prefix cache when the table was made

    @property
    def frozen(self) -> int:
        """Slots in blocks that are shared or cached (``[0, frozen)`` is never written or rolled back)."""
        return len(self.digests) * self.pool.block_size

    def publish(self, ids: list[int]) -> None:
        """Register the table's full committed blocks in the prefix cache (``ids``: the ids of slots
        ``[0, length)`` at least); a no-op without a cache."""
        cache, size = self.pool.cache, self.pool.block_size
        if cache is None:
            return
        if len(ids) < self.length:
            raise ValueError(f"{len(ids)} ids for {self.length} committed slots")
        while self.frozen + size <= self.length:
            index = len(self.digests)
            chunk = tuple(ids[index * size : (index + 1) * size])
            digest = chain_digest(self.digests[-1] if self.digests else ROOT, chunk)
            cache.register(self.blocks[index], digest, chunk)  # False: cached elsewhere, this block stays private
            self.digests.append(digest)

    def write_taps(self, start: int, taps: tuple[torch.Tensor, ...]) -> None:
        """Store the tapped hidden states of slots ``[start, start + n)`` (``taps``: per pool tap layer,
        [1, n, D]); a no-op when the pool keeps none."""
        if self.pool.taps is None:
            return
        for pool_start, offset, n in self._runs(start, start + taps[0].shape[1]):
            for rows, tap in zip(self.pool.taps, taps):
                rows[pool_start : pool_start + n] = tap[0, offset : offset + n]  # [n, D]

    def _runs(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """Slots ``[start, end)`` (allocated) as runs of consecutive pool slots: (pool slot, offset from start,
        length); slice copies, where an index copy of a long prompt chunk is slow on a CPU."""
        size = self.pool.block_size
        if end > len(self.blocks) * size:
            raise ValueError(f"slot {end - 1} is not allocated")
        runs: list[tuple[int, int, int]] = []
        position = start
        while position < end:
            n = min(end, (position // size + 1) * size) - position
            pool_slot = self.blocks[position // size] * size + position % size
            if runs and runs[-1][0] + runs[-1][2] == pool_slot:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((pool_slot, position - start, n))
            position += n
        return runs

    def read_taps(self, end: int, layers: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """The stored hidden states of slots ``[0, end)`` at ``layers`` (each a pool tap layer): [1, end, D] each."""
        if self.pool.taps is None:
            raise ValueError("the pool keeps no hidden states")
        missing = [layer for layer in layers if layer not in self.pool.tap_layers]
        if missing:
            raise ValueError(f"layers {missing} are not kept by the pool (it keeps {self.pool.tap_layers})")
        slots = self._pool_slots(torch.arange(end)).to(self.pool.taps.device)  # [end]
        return tuple(self.pool.taps[self.pool.tap_layers.index(layer)].index_select(0, slots)[None] for layer in layers)

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
        if not positions.numel():
            return positions.to(torch.int64)
        if int(positions.max()) >= len(self.blocks) * size:
            raise ValueError(f"slot {int(positions.max())} is not allocated")
        first = int(positions.min()) // size  # only the blocks the positions fall in
        blocks = torch.tensor(self.blocks[first : int(positions.max()) // size + 1], dtype=torch.int64)
        return blocks[positions // size - first] * size + positions % size

    def rollback(self, length: int) -> None:
        """Keep slots ``[0, length)``; blocks wholly past ``length`` go back to the pool."""
        if not 0 <= length <= len(self.blocks) * self.pool.block_size:
            raise ValueError(f"cannot set length {length}: {len(self.blocks)} blocks allocated")
        if length < self.frozen:
            raise ValueError(f"cannot set length {length}: slots [0, {self.frozen}) are shared or cached")
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
        self.digests = []
        self.pool.reserved -= self.reserved_blocks
        self.released = True
