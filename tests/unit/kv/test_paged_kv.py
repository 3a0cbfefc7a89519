import pytest
import torch

from dflash2.kv.paged import KVBudgetError, PagedKVPool


def make_pool(num_blocks=6, block_size=4):
    return PagedKVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=num_blocks, block_size=block_size,
                       dtype=torch.float32)


def test_slots_follow_the_block_table_and_blocks_are_taken_lazily():
    pool = make_pool()
    a, b = pool.new_table(12), pool.new_table(8)
    assert pool.reserved == 5 and pool.blocks_used == 0
    slots_a = a.slots(0, 5)  # two blocks for a
    slots_b = b.slots(0, 3)  # one block for b
    assert pool.blocks_used == 3
    assert slots_a.tolist() == [a.blocks[0] * 4 + i for i in range(4)] + [a.blocks[1] * 4]
    assert set(slots_b.tolist()).isdisjoint(slots_a.tolist())


def test_rollback_returns_whole_blocks_past_the_length_and_release_everything():
    pool = make_pool()
    table = pool.new_table(16)
    table.slots(0, 11)
    assert len(table.blocks) == 3
    table.rollback(5)  # slots 0..4: two blocks kept, the third goes back
    assert table.length == 5 and len(table.blocks) == 2 and pool.blocks_used == 2
    table.rollback(4)
    assert len(table.blocks) == 1
    table.release()
    table.release()  # idempotent
    assert pool.blocks_used == 0 and pool.reserved == 0
    with pytest.raises(ValueError):
        table.slots(0, 1)


def test_reservations_bound_admission():
    pool = make_pool(num_blocks=4)
    with pytest.raises(KVBudgetError) as never:
        pool.new_table(17)  # 5 blocks > the pool
    assert never.value.never
    first = pool.new_table(12)
    with pytest.raises(KVBudgetError) as later:
        pool.new_table(8)  # 2 more blocks: only 1 unreserved
    assert not later.value.never
    first.release()
    pool.new_table(8)


def test_a_table_cannot_grow_past_its_reservation():
    table = make_pool().new_table(5)  # two blocks reserved
    table.slots(0, 8)
    with pytest.raises(ValueError, match="reserved"):
        table.slots(0, 9)


def test_a_block_table_commits_like_the_static_cache():
    """rollback and compact (a verified tree's accepted branch becomes a chain) give the paged cache the same
    keys/values per committed slot as the static cache: one commit rule for every loop."""
    import torch

    from dflash2.decode.step import commit_kept
    from dflash2.kv import StaticKVCache
    from dflash2.kv.paged import PagedKVPool

    layers, heads, dim, size = 2, 2, 4, 4
    pool = PagedKVPool(layers, heads, dim, num_blocks=8, block_size=size, dtype=torch.float32)
    table = pool.new_table(20)
    static = StaticKVCache(layers, heads, dim, 20, dtype=torch.float32)
    values = torch.randn(layers, 14, heads, dim)  # one entry per slot written
    committed = table.slots(0, 6)  # a committed prefix of 6 slots
    pool.keys[:, committed], pool.values[:, committed] = values[:, :6], -values[:, :6]
    table.rollback(6)
    written = table.slots(6, 14)  # a verification pass writes 8 more (the table's length stays 6)
    pool.keys[:, written], pool.values[:, written] = values[:, 6:], -values[:, 6:]
    static.keys[:, 0, :, :14], static.values[:, 0, :, :14] = values.transpose(1, 2), -values.transpose(1, 2)
    static.length = 6
    for cache in (table, static):  # a tree over [6, 14): the pending token and nodes 2, 5, 7 are kept
        commit_kept(cache, 6, [0, 2, 5, 7])
    assert table.length == static.length == 10
    kept = table.slots(0, 10)
    assert torch.equal(pool.keys[:, kept], static.keys[:, 0, :, :10].transpose(1, 2))
    assert torch.equal(pool.values[:, kept], static.values[:, 0, :, :10].transpose(1, 2))
    assert len(table.blocks) == 3  # slots 10.. are free again past the last block in use
