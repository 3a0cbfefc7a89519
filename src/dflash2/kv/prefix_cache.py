"""Automatic prefix caching: full KV blocks kept after their sequence moves on or ends, keyed by the ids they hold.

Block i of a sequence is keyed by a hash chain, ``digest_i = blake2b(digest_{i-1} || ids of block i)`` (16 bytes),
so a key names the whole prefix up to the end of its block: two sequences that share their first n full blocks
share those n keys. A block is registered once it is full and committed (its slots are never written again: a
sequence only writes at or past its committed length), so only full blocks are ever shared; the partially filled
last block of a sequence is always its own and no copy on write is needed. The cached ids of each block are kept
and compared on a hit as well, so a hash collision could only matter through a colliding parent chain.

This module holds the registry and the LRU order; reference counts and the free list live in the pool
(:class:`~dflash2.kv.paged.PagedKVPool`): a cached block nobody references is *evictable* and is handed out again,
least recently used first, only when the free list is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT = b""  # the digest before the first block


def chain_digest(parent: bytes, ids: tuple[int, ...]) -> bytes:
    """The key of a block holding ``ids`` after the prefix keyed ``parent``."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", ids).tobytes())  # 8 bytes an id
    return h.digest()


@dataclass(frozen=True)
class CachedBlock:
    digest: bytes  # the key of the prefix ending with this block
    ids: tuple[int, ...]  # [block_size] the token ids whose keys/values the block holds


@dataclass(frozen=True)
class PrefixHit:
    blocks: list[int]  # pool block ids of the longest cached prefix, in order
    digests: list[bytes]  # their keys


class PrefixCache:
    """Full blocks by key, and the least-recently-used order of those no sequence references."""

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self._by_digest: dict[bytes, int] = {}
        self._blocks: dict[int, CachedBlock] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, least recently used first
        self.queried_tokens = 0  # prompt tokens looked up (admissions)
        self.hit_tokens = 0  # of those, found cached

    @property
    def num_cached(self) -> int:
        """Blocks registered (referenced or not)."""
        return len(self._blocks)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no sequence references: memory the pool can hand out again."""
        return len(self._lru)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def holds(self, block: int) -> bool:
        return block in self._blocks

    def match(self, ids: list[int]) -> PrefixHit:
        """The longest run of cached full blocks that starts ``ids`` (a partial last block never matches)."""
        size = self.block_size
        blocks: list[int] = []
        digests: list[bytes] = []
        parent = ROOT
        for start in range(0, len(ids) - size + 1, size):
            chunk = tuple(ids[start : start + size])
            digest = chain_digest(parent, chunk)
            block = self._by_digest.get(digest)
            if block is None or self._blocks[block].ids != chunk:
                break
            blocks.append(block)
            digests.append(digest)
            parent = digest
        return PrefixHit(blocks, digests)

    def count_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def register(self, block: int, digest: bytes, ids: tuple[int, ...]) -> bool:
        """Register a full, committed block; False when that prefix is cached already (in another block, which
        stays the cached one: this block remains private to its sequence)."""
        if len(ids) != self.block_size:
            raise ValueError(f"only full blocks are cached: {len(ids)} ids, block size {self.block_size}")
        if digest in self._by_digest or block in self._blocks:
            return False
        self._by_digest[digest] = block
        self._blocks[block] = CachedBlock(digest, ids)
        return True

    def park(self, block: int) -> None:
        """The last reference to a cached block went away: it becomes evictable, most recently used."""
        self._lru[block] = None
        self._lru.move_to_end(block)

    def unpark(self, block: int) -> None:
        """A sequence references the block again: it is not evictable any more."""
        self._lru.pop(block, None)

    def evict(self) -> int:
        """Forget the least recently used unreferenced block and return its id (the caller reuses it)."""
        if not self._lru:
            raise RuntimeError("no evictable block: the pool's reservations should have prevented this")
        block, _ = self._lru.popitem(last=False)
        del self._by_digest[self._blocks.pop(block).digest]
        return block
