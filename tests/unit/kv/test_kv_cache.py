import pytest
import torch

from dflash2.kv import StaticKVCache


def make_cache(capacity=8):
    return StaticKVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=capacity, dtype=torch.float32)


def block(value, length):
    return torch.full((1, 1, length, 2), float(value))


def test_write_returns_all_visible_slots_and_advance_commits():
    cache = make_cache()
    keys, values = cache.write(0, block(1, 3), block(2, 3))
    assert keys.shape == (1, 1, 3, 2) and cache.length == 0
    cache.advance(3)
    keys, _ = cache.write(0, block(5, 2), block(5, 2))
    assert keys.shape == (1, 1, 5, 2)
    assert keys[0, 0, :, 0].tolist() == [1, 1, 1, 5, 5]


def test_rollback_is_a_pointer_move_and_next_write_overwrites():
    cache = make_cache()
    cache.write(0, block(1, 6), block(1, 6))
    cache.advance(6)
    storage = cache.keys.data_ptr()
    cache.rollback(2)
    assert cache.length == 2 and cache.keys.data_ptr() == storage
    keys, _ = cache.write(0, block(9, 1), block(9, 1))
    assert keys[0, 0, :, 0].tolist() == [1, 1, 9]


@pytest.mark.parametrize("bad", [-1, 5])
def test_rollback_beyond_bounds_raises(bad):
    cache = make_cache()
    cache.advance(4)
    with pytest.raises(ValueError):
        cache.rollback(bad)


def test_overflow_raises_instead_of_wrapping():
    cache = make_cache(capacity=4)
    cache.advance(3)
    with pytest.raises(ValueError, match="overflow"):
        cache.write(0, block(1, 2), block(1, 2))


def test_compact_moves_accepted_branch_to_consecutive_slots():
    cache = make_cache()
    for layer in range(2):
        cache.write(layer, torch.arange(6.0).view(1, 1, 6, 1).expand(1, 1, 6, 2), block(0, 6))
    cache.advance(6)
    cache.compact(torch.tensor([3, 5]), destination=3)
    assert cache.length == 5
    assert cache.keys[1, 0, 0, :5, 0].tolist() == [0, 1, 2, 3, 5]
