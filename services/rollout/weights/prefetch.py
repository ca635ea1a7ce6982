"""A weight directory read and verified before it is applied (LoadWeights with `prefetch`).

Reading a version the trainer wrote (pread on every core, the sha256 of each block, the finite check) is
most of what loading it costs; copying the verified tensors into the engine is a small part. A replica
told to prefetch a directory reads it while it still generates with the version it holds, into its
staging memory, and keeps the result; the LoadWeights of the same directory, version and digest then only
applies it, between two Generate calls.

Two reads are kept at most, the newest versions: in fixed_lag the coordinator has the replicas prefetch
version s as soon as step s trained, and the sync to version s - 1 (beside that training) can reach the
replica after it, so the older one must survive the newer one's prefetch. A load lets go of every kept read
of its version or older (none of them can be applied later); a third prefetch lets go of the oldest.

A failed read is never kept: its error answers the prefetch, and the load that follows reads again.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
import torch

from services.common.weights.files import WeightFiles
from services.rollout.weights.staging_arena import StagingArena

# A prefetch reads beside the engine's decode loop, in its process: every reading thread takes the GIL
# between two blocks, and a decode loop that waits for it launches its kernels later. So a prefetch reads
# with a few threads (a load, which the engine waits for, reads with one per core).
PREFETCH_READ_THREADS = min(4, os.cpu_count() or 1)

Allocate = Callable[[int], torch.Tensor]
ReadDirectory = Callable[[Allocate], tuple[dict[str, torch.Tensor], WeightFiles]]


@dataclass(frozen=True)
class DirectoryKey:
    """What a load must name to be given a prefetched read: the trainer's directory, its version, its digest."""

    directory: str
    policy_version: int
    sha256: str


@dataclass
class _Kept:
    key: DirectoryKey
    read: asyncio.Future      # -> (tensors, files); runs in a thread, writing into the lease's memory
    lease: contextlib.ExitStack  # the staging lease the tensors live in, released once the read is let go


KEPT_READS = 2
"""Prefetched directories kept at once (each holds a copy of the weights in staging memory)."""


class WeightPrefetch:
    """`arena()`: the replica's staging arena (looked up at each read: it depends on the engine loaded)."""

    def __init__(self, arena: Callable[[], StagingArena]) -> None:
        self._arena = arena
        self._kept: list[_Kept] = []  # oldest version first
        self._lock = asyncio.Lock()

    async def prefetch(self, key: DirectoryKey, read: ReadDirectory) -> WeightFiles:
        """Read and verify `key`'s directory now and keep it (a prefetch of a kept key waits for that read)."""
        async with self._lock:
            kept = next((k for k in self._kept if k.key == key), None)
            if kept is None:
                # Another directory of the same version (a recovered trainer wrote it again) replaces it.
                await self._let_go([k for k in self._kept if k.key.policy_version == key.policy_version])
                lease = contextlib.ExitStack()
                allocate = lease.enter_context(self._arena().lease()).allocate
                kept = _Kept(key, asyncio.ensure_future(asyncio.to_thread(read, allocate)), lease)
                self._kept = sorted([*self._kept, kept], key=lambda k: k.key.policy_version)
                await self._let_go(self._kept[:-KEPT_READS])
        try:
            _, files = await asyncio.shield(kept.read)
        except Exception:
            async with self._lock:
                await self._let_go([kept] if kept in self._kept else [])
            raise
        return files

    @contextlib.asynccontextmanager
    async def loaded(self, key: DirectoryKey, read: ReadDirectory
                     ) -> AsyncIterator[tuple[dict[str, torch.Tensor], WeightFiles, bool]]:
        """The tensors and files of `key`'s directory, and whether a prefetch had read them; read now, into
        the arena, when no prefetch of `key` is kept. Valid inside the block: the engine copies them in there.
        Kept reads of `key`'s version or older are let go; newer ones stay for their own loads."""
        async with self._lock:
            mine = next((k for k in self._kept if k.key == key), None)
            stale = [k for k in self._kept if k is not mine and k.key.policy_version <= key.policy_version]
            self._kept = [k for k in self._kept if k is not mine and k not in stale]
        for kept in stale:
            await _released(kept)
        if mine is not None:
            got = None
            try:
                with contextlib.suppress(Exception):  # the prefetch's error was its answer: read again below
                    got = await asyncio.shield(mine.read)
                if got is not None:
                    yield got[0], got[1], True
                    return
            finally:
                await _released(mine)
        with self._arena().lease() as lease:
            tensors, files = await asyncio.to_thread(read, lease.allocate)
            yield tensors, files, False

    async def release(self) -> None:
        """Let every kept read go (a new model is loaded: no directory of the old run is wanted)."""
        async with self._lock:
            await self._let_go(list(self._kept))

    async def _let_go(self, reads: list[_Kept]) -> None:
        """Take `reads` off the kept list and release them (under the lock)."""
        self._kept = [k for k in self._kept if k not in reads]
        for kept in reads:
            await _released(kept)


async def _released(kept: _Kept) -> None:
    """Wait for the read (its thread writes into the lease's memory) before the lease goes back."""
    with contextlib.suppress(Exception):
        await asyncio.shield(kept.read)
    kept.lease.close()
