"""ReplicaPool bookkeeping: which replicas a run shards over, probes, and syncs."""
from __future__ import annotations

import pytest

from services.coordinator.replicas import NoLiveReplica, ReplicaPool


class _Client:
    def __init__(self, address: str) -> None:
        self.address = address


def test_evicted_replicas_leave_sharding_until_readmitted_in_configuration_order():
    a, b, c = _Client("a:1"), _Client("b:1"), _Client("c:1")
    pool = ReplicaPool([a, b, c])
    assert pool.live() == [a, b, c] and pool.evicted() == []
    assert pool.evict(b) is True and pool.evict(b) is False  # a second failure is not a new eviction
    assert pool.live() == [a, c] and pool.evicted() == [b] and not pool.is_live(b)
    pool.readmit(b)
    assert pool.live() == [a, b, c]  # back in its configured place: sharding stays a function of the list


def test_no_live_replica_is_an_error_naming_every_address():
    a, b = _Client("a:1"), _Client("b:1")
    pool = ReplicaPool([a, b])
    pool.evict(a)
    assert pool.require_live("weight sync") == [b]
    pool.evict(b)
    with pytest.raises(NoLiveReplica, match=r"weight sync: every rollout replica is unavailable \(a:1, b:1\)"):
        pool.require_live("weight sync")
    assert pool.evicted() == [a, b]  # what the driver probes while it waits for one to come back


def test_a_pool_needs_a_replica():
    with pytest.raises(ValueError, match="rollout_addresses"):
        ReplicaPool([])
