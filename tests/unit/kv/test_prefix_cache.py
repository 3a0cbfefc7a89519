"""The prefix cache's bookkeeping: block keys (a hash chain), sharing with reference counts, LRU eviction of
unreferenced blocks inside the pool, and shared blocks never written or rolled back."""

from __future__ import annotations

import pytest
import torch

from dflash2.kv.paged import KVBudgetError, PagedKVPool
from dflash2.kv.prefix_cache import ROOT, PrefixCache, chain_digest


def make_pool(num_blocks: int = 8, block_size: int = 4, **kwargs) -> PagedKVPool:
    return PagedKVPool(1, 1, 2, num_blocks, block_size, dtype=torch.float32, prefix_cache=True, **kwargs)


def fill(table, ids: list[int]) -> None:
    """Commit ``ids`` after the table's length (the forward writes; here only the slots matter) and publish."""
    table.slots(0, len(ids))
    table.rollback(len(ids))
    table.publish(ids)


def test_a_key_names_the_whole_prefix():
    a = chain_digest(ROOT, (1, 2, 3, 4))
    assert a == chain_digest(ROOT, (1, 2, 3, 4)) and len(a) == 16
    assert chain_digest(a, (5, 6, 7, 8)) != chain_digest(chain_digest(ROOT, (0, 2, 3, 4)), (5, 6, 7, 8))
    assert chain_digest(ROOT, (1, 2)) != chain_digest(ROOT, (2, 1))
    assert chain_digest(ROOT, (-1,)) != chain_digest(ROOT, (2**64 - 1 - 2**63,))


def test_only_full_committed_blocks_are_cached_and_matched():
    pool = make_pool(num_blocks=32)
    table = pool.new_table(16, [1] * 3)
    assert table.length == 0 and pool.cache.hit_tokens == 0
    fill(table, list(range(10)))  # two full blocks and a partial one
    assert pool.blocks_cached == 2 and table.frozen == 8
    again = pool.new_table(16, list(range(10)) + [99])
    assert again.length == again.cached_tokens == 8 and again.blocks == table.blocks[:2]
    assert pool.new_table(16, list(range(8))).length == 4  # the last prompt id is always fed: 7 ids -> 1 block
    assert pool.new_table(16, [0, 1, 2, 9, 4, 5, 6, 7, 8]).length == 0  # differs inside the first block


def test_shared_blocks_are_counted_and_survive_their_first_owner():
    pool = make_pool()
    first = pool.new_table(12, None)
    fill(first, list(range(9)))
    second = pool.new_table(12, list(range(9)))
    assert second.blocks == first.blocks[:2] and pool.blocks_used == 3
    first.release()
    assert pool.blocks_used == 2 and pool.blocks_evictable == 0  # the shared blocks are held by the second
    second.release()
    assert pool.blocks_used == 0 and pool.blocks_evictable == 2 and pool.reserved == 0
    third = pool.new_table(12, list(range(9)))  # an evictable block is taken back from the LRU
    assert third.length == 8 and pool.blocks_evictable == 0 and pool.blocks_used == 2


def test_shared_slots_are_never_rolled_back_or_written():
    pool = make_pool()
    first = pool.new_table(16)
    fill(first, list(range(8)))
    with pytest.raises(ValueError, match="shared or cached"):
        first.rollback(6)
    second = pool.new_table(16, list(range(8)) + [5])
    with pytest.raises(ValueError, match="shared or cached"):
        second.rollback(3)
    assert second.length == 8  # writes start at the length: a forward never touches slots [0, 8)


def test_unreferenced_blocks_are_evicted_least_recently_used_first_and_tails_before_prefixes():
    pool = make_pool(num_blocks=4, block_size=2)
    a = pool.new_table(4)
    fill(a, [1, 2, 3, 4])
    a.release()
    b = pool.new_table(4)
    fill(b, [5, 6, 7, 8])
    b.release()
    assert pool.blocks_evictable == 4 and pool.blocks_used == 0

    def cached(ids: list[int]) -> int:  # a lookup without side effects
        return len(pool.cache.match(ids).blocks)

    c = pool.new_table(4)  # every block is cached: growing evicts the oldest unreferenced ones
    c.slots(0, 2)
    assert cached([1, 2, 3, 4]) == 1 and cached([5, 6, 7, 8]) == 2  # a's tail went first, its first block stays
    c.slots(2, 4)
    assert cached([1, 2, 3, 4]) == 0 and cached([5, 6, 7, 8]) == 2
    c.release()
    d = pool.new_table(4, [5, 6, 7, 8, 0])  # a hit makes b's blocks the most recently used
    assert d.length == 4
    d.release()
    e = pool.new_table(4)
    e.slots(0, 4)  # the two free blocks (c's, never cached) are taken before any cached one is evicted
    assert cached([5, 6, 7, 8]) == 2


def test_reservations_still_bound_the_pool_with_cached_blocks_around():
    pool = make_pool(num_blocks=4, block_size=2)
    a = pool.new_table(8)
    fill(a, list(range(8)))
    with pytest.raises(KVBudgetError):
        pool.new_table(2, list(range(3)))  # a reserves the whole pool, its blocks are not evictable
    a.release()
    shared = pool.new_table(8, list(range(7)) + [1])
    assert shared.length == 6 and pool.reserved == 4
    shared.slots(6, 8)  # grows into the evictable last block (the prompt's own last block is private)
    assert pool.blocks_used == 4 and pool.blocks_evictable == 0


def test_a_duplicate_block_stays_private_and_is_freed():
    pool = make_pool()
    a, b = pool.new_table(8), pool.new_table(8)
    fill(a, list(range(8)))
    fill(b, list(range(8)))  # computed in parallel before a's blocks were cached
    assert pool.blocks_cached == 2 and pool.blocks_used == 4
    b.release()
    assert pool.blocks_used == 2 and pool.blocks_evictable == 0
    a.release()
    assert pool.blocks_evictable == 2


def test_taps_are_kept_per_slot_and_read_back():
    pool = make_pool(tap_layers=(1, 3), tap_width=2)
    table = pool.new_table(8)
    taps = (torch.arange(10.0).view(1, 5, 2), -torch.arange(10.0).view(1, 5, 2))  # layers 1 and 3, [1, 5, 2]
    fill(table, list(range(5)))  # the forward allocates the slots before the taps are written
    table.write_taps(0, taps)
    three, one = table.read_taps(5, (3, 1))
    assert torch.equal(three, taps[1]) and torch.equal(one, taps[0])
    with pytest.raises(ValueError, match="not kept"):
        table.read_taps(5, (2,))


def test_cache_registry_refuses_partial_blocks_and_counts_hits():
    cache = PrefixCache(4)
    with pytest.raises(ValueError, match="full blocks"):
        cache.register(0, b"x", (1, 2))
    assert cache.register(0, chain_digest(ROOT, (1, 2, 3, 4)), (1, 2, 3, 4))
    assert not cache.register(1, chain_digest(ROOT, (1, 2, 3, 4)), (1, 2, 3, 4))
    assert cache.match([1, 2, 3, 4, 5]).blocks == [0]
    cache.count_lookup(10, 4)
    assert cache.hit_rate == 0.4
    with pytest.raises(RuntimeError, match="no evictable"):
        cache.evict()
