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
