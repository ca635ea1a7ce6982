"""A weight directory read and verified before it is applied (LoadWeights with `prefetch`).

Reading a version the trainer wrote (pread on every core, the sha256 of each block, the finite check) is
most of what loading it costs; copying the verified tensors into the engine is a small part. A replica
told to prefetch a directory reads it while it still generates with the version it holds, into its
staging memory, and keeps the result; the LoadWeights of the same directory, version and digest then only
applies it, between two Generate calls. One directory is kept at a time: a prefetch of another, or a load
of another, lets the kept one go (its staging memory returns to the arena).

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


class WeightPrefetch:
    """`arena()`: the replica's staging arena (looked up at each read: it depends on the engine loaded)."""

    def __init__(self, arena: Callable[[], StagingArena]) -> None:
        self._arena = arena
        self._kept: _Kept | None = None
        self._lock = asyncio.Lock()

    async def prefetch(self, key: DirectoryKey, read: ReadDirectory) -> WeightFiles:
        """Read and verify `key`'s directory now and keep it (a prefetch of the kept key waits for that read)."""
        async with self._lock:
            if self._kept is None or self._kept.key != key:
                await self._let_go()
                lease = contextlib.ExitStack()
                allocate = lease.enter_context(self._arena().lease()).allocate
                self._kept = _Kept(key, asyncio.ensure_future(asyncio.to_thread(read, allocate)), lease)
            kept = self._kept
        try:
            _, files = await asyncio.shield(kept.read)
        except Exception:
            async with self._lock:
                if self._kept is kept:
                    await self._let_go()
            raise
        return files

    @contextlib.asynccontextmanager
    async def loaded(self, key: DirectoryKey, read: ReadDirectory
                     ) -> AsyncIterator[tuple[dict[str, torch.Tensor], WeightFiles, bool]]:
        """The tensors and files of `key`'s directory, and whether a prefetch had read them; read now, into
        the arena, when no prefetch of `key` is kept. Valid inside the block: the engine copies them in there."""
        async with self._lock:
            kept, self._kept = self._kept, None
        if kept is not None:
            got = None
            try:
                if kept.key == key:
                    with contextlib.suppress(Exception):  # the prefetch's error was its answer: read again below
                        got = await asyncio.shield(kept.read)
                if got is not None:
                    yield got[0], got[1], True
                    return
            finally:
                await _released(kept)
        with self._arena().lease() as lease:
            tensors, files = await asyncio.to_thread(read, lease.allocate)
            yield tensors, files, False

    async def release(self) -> None:
        """Let the kept read go (a new model is loaded: no directory of the old run is wanted)."""
        async with self._lock:
            await self._let_go()

    async def _let_go(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            await _released(kept)


async def _released(kept: _Kept) -> None:
    """Wait for the read (its thread writes into the lease's memory) before the lease goes back."""
    with contextlib.suppress(Exception):
        await asyncio.shield(kept.read)
    kept.lease.close()
