"""A replica's receive memory is kept between syncs: the second sync of the same tensors lands in the
first one's memory, a larger sync grows the arena for the next, and a sync that finds the arena leased
gets memory of its own rather than sharing it."""
from __future__ import annotations

import torch

from services.rollout.weights.staging_arena import StagingArena


def _take(lease, sizes):
    return [lease.allocate(n) for n in sizes]


def test_the_next_sync_reuses_the_last_ones_memory_and_grows_once():
    arena = StagingArena(pin_memory=False)
    with arena.lease() as lease:
        first = _take(lease, [100, 3, 4096])
    assert all(t.numel() == n for t, n in zip(first, [100, 3, 4096]))
    with arena.lease() as lease:
        second = _take(lease, [100, 3, 4096])
    assert arena.capacity >= 100 + 3 + 4096
    assert [t.data_ptr() % 64 for t in second] == [0, 0, 0]
    with arena.lease() as lease:
        third = _take(lease, [100, 3, 4096])
    assert [t.data_ptr() for t in third] == [t.data_ptr() for t in second]  # the same memory
    with arena.lease() as lease:
        bigger = _take(lease, [100, 3, 4096, 10_000])
    assert [t.data_ptr() for t in bigger[:3]] == [t.data_ptr() for t in second]
    with arena.lease() as lease:
        _take(lease, [100])
    assert arena.capacity >= 100 + 3 + 4096 + 10_000


def test_a_second_lease_meanwhile_gets_its_own_memory():
    arena = StagingArena(pin_memory=False)
    with arena.lease() as lease:
        _take(lease, [1 << 16])
    with arena.lease() as held:
        mine = held.allocate(1 << 16)
        with arena.lease() as other:
            theirs = other.allocate(1 << 16)
            mine.fill_(1)
            theirs.fill_(2)
            assert bool((mine == 1).all()) and theirs.untyped_storage().data_ptr() != mine.untyped_storage().data_ptr()
    with arena.lease() as again:
        assert again.allocate(1 << 16).data_ptr() == mine.data_ptr()
    assert isinstance(mine, torch.Tensor)
