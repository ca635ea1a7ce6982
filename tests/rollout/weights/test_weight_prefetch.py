"""WeightPrefetch: the bookkeeping of LoadWeights' prefetch (the read is a stand-in that counts its calls and
writes into the memory it is given; the real read through gRPC is tests/integration/weights/test_shared_path_weights.py).

A load of the prefetched directory is given the prefetched read; a load of another reads itself and lets kept
reads of its version or older go; the two newest versions are kept (a sync of the older one can arrive after
the newer one's prefetch); a failed prefetch is not kept; the staging lease goes back to the arena once the
load is done."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from services.common.weights.files import WeightFiles
from services.rollout.weights.prefetch import DirectoryKey, WeightPrefetch
from services.rollout.weights.staging_arena import StagingArena

A = DirectoryKey("/w/v000001", 1, "a" * 64)
B = DirectoryKey("/w/v000002", 2, "b" * 64)
C = DirectoryKey("/w/v000003", 3, "c" * 64)


class Reads:
    def __init__(self) -> None:
        self.calls: list[DirectoryKey] = []
        self.fail: set[DirectoryKey] = set()
        self.release = threading.Event()
        self.release.set()

    def of(self, key: DirectoryKey):
        def read(allocate):
            self.calls.append(key)
            self.release.wait(10)
            if key in self.fail:
                raise ValueError(f"expected_sha256: {key.directory} does not hash to it")
            t = allocate(8)
            t.fill_(key.policy_version)
            return {"w": t}, WeightFiles(Path(key.directory), key.policy_version, 1, 8, key.sha256)
        return read


def run(coro):
    return asyncio.run(coro)


def test_a_load_of_the_prefetched_directory_applies_the_prefetched_read():
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        files = await prefetch.prefetch(A, reads.of(A))
        assert files.policy_version == 1 and arena._leased  # the kept read holds the staging memory
        await prefetch.prefetch(A, reads.of(A))  # the kept one again: not read twice
        async with prefetch.loaded(A, reads.of(A)) as (tensors, got, early):
            assert early and got.total_sha256 == A.sha256 and torch.equal(tensors["w"], torch.ones(8, dtype=torch.uint8))
        assert not arena._leased
        async with prefetch.loaded(A, reads.of(A)) as (_, _, early):  # taken once: the next load reads
            assert not early

    run(scenario())
    assert reads.calls == [A, A]


def test_a_load_of_another_directory_reads_it_and_lets_the_prefetched_one_go():
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        await prefetch.prefetch(A, reads.of(A))
        async with prefetch.loaded(B, reads.of(B)) as (tensors, got, early):
            assert not early and got.policy_version == 2 and int(tensors["w"][0]) == 2
        async with prefetch.loaded(A, reads.of(A)) as (_, _, early):
            assert not early  # A was let go when B was loaded

    run(scenario())
    assert reads.calls == [A, B, A] and not arena._leased


def test_the_older_version_survives_the_newer_ones_prefetch_and_both_loads_apply_their_reads():
    # fixed_lag: version 2's prefetch (step 2 trained) reaches the replica before the sync to version 1.
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        await prefetch.prefetch(A, reads.of(A))
        await prefetch.prefetch(B, reads.of(B))
        assert await _load(prefetch, A, reads) is True
        assert await _load(prefetch, B, reads) is True

    run(scenario())
    assert reads.calls == [A, B] and not arena._leased


def test_a_third_prefetch_lets_the_oldest_go_and_a_load_lets_older_ones_go():
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        for key in (A, B, C):
            await prefetch.prefetch(key, reads.of(key))
        assert await _load(prefetch, A, reads) is False  # let go for C
        await prefetch.prefetch(A, reads.of(A))
        assert await _load(prefetch, C, reads) is True  # and lets the older A and B go
        assert await _load(prefetch, B, reads) is False
        assert await _load(prefetch, A, reads) is False

    run(scenario())
    assert reads.calls == [A, B, C, A, A, B, A] and not arena._leased


def test_another_directory_of_a_kept_version_replaces_it():
    # A recovered trainer writes a version again, to a fresh directory with its own digest.
    again = DirectoryKey("/w/v000001-again", 1, "d" * 64)
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        await prefetch.prefetch(A, reads.of(A))
        await prefetch.prefetch(again, reads.of(again))
        assert await _load(prefetch, again, reads) is True
        assert await _load(prefetch, A, reads) is False  # replaced by the other directory's prefetch

    run(scenario())
    assert reads.calls == [A, again, A] and not arena._leased


def test_a_failed_prefetch_is_refused_and_not_kept():
    arena, reads = StagingArena(pin_memory=False), Reads()
    reads.fail.add(A)
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        with pytest.raises(ValueError, match="does not hash"):
            await prefetch.prefetch(A, reads.of(A))
        assert not arena._leased
        reads.fail.clear()  # the directory is whole again: the load reads it itself
        async with prefetch.loaded(A, reads.of(A)) as (_, got, early):
            assert not early and got.policy_version == 1

    run(scenario())
    assert reads.calls == [A, A]


def test_a_load_arriving_while_the_prefetch_reads_waits_for_it():
    arena, reads = StagingArena(pin_memory=False), Reads()
    reads.release.clear()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        ahead = asyncio.ensure_future(prefetch.prefetch(A, reads.of(A)))
        while not reads.calls:
            await asyncio.sleep(0.01)
        loading = asyncio.ensure_future(_load(prefetch, A, reads))
        await asyncio.sleep(0.05)
        assert not loading.done()
        reads.release.set()
        assert await loading is True and (await ahead).policy_version == 1

    run(scenario())
    assert reads.calls == [A]


def test_an_error_while_applying_is_raised_and_the_memory_goes_back():
    arena, reads = StagingArena(pin_memory=False), Reads()
    prefetch = WeightPrefetch(lambda: arena)

    async def scenario():
        await prefetch.prefetch(A, reads.of(A))
        with pytest.raises(RuntimeError, match="engine refused"):
            async with prefetch.loaded(A, reads.of(A)):
                raise RuntimeError("engine refused")

    run(scenario())
    assert not arena._leased and reads.calls == [A]


async def _load(prefetch: WeightPrefetch, key: DirectoryKey, reads: Reads) -> bool:
    async with prefetch.loaded(key, reads.of(key)) as (_, _, early):
        return early
