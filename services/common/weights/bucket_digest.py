"""The weights digest (services/common/weights/digest.py) of tensors packed in buckets, on either side of an
IPC handover: the trainer over the buckets it shares, the replica over what it mapped.

Work is one digest block (a tensor's 4 MiB piece, digest.block_sha256), hashed on a thread pool (hashlib
releases the GIL). Buckets
in host memory are hashed where they lie. Device buckets are copied to the host in pieces of up to
PIECE_BYTES (whole blocks) through a small ring of pinned buffers on a stream of their own, so the copy of one
piece overlaps the hashing of the ones before: the ring is allocated at the first use and kept by its
BucketHasher, and is small (RING_PIECES x PIECE_BYTES), so a first sync pays little more than a later one.

`on="device"` hashes the whole 4 MiB blocks of device buckets on the device instead (kernels/digest: one lane
per 256 KiB leaf, then one per block over its leaf digests; every bucket's launches on a stream of its own), and only each tensor's shorter last block on the host
as above: the same digest, without copying most bytes to the host or spending every core on them. Buckets in
host memory are hashed on the host whatever `on` says.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.common.weights.digest import (DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES, block_pool_threads, block_sha256,
                                            block_spans, digest_of_blocks)
from services.common.weights.ipc_transport import BucketLayout

PIECE_BYTES = 64 * 1024 * 1024
RING_PIECES = 4
DIGEST_ON = ("host", "device")


def block_ranges(layout: BucketLayout) -> list[tuple[int, int]]:
    """Pure. (start, end) in the bucket of every digest block of its tensors, in digest order."""
    out = []
    for slot in layout.slots:
        for offset in block_spans(slot.nbytes):
            out.append((slot.offset + offset, slot.offset + min(offset + DIGEST_BLOCK_BYTES, slot.nbytes)))
    return out


def pieces(blocks: Sequence[tuple[int, int]], piece_bytes: int) -> list[list[tuple[int, int]]]:
    """Pure. Consecutive blocks grouped so that each group spans at most `piece_bytes` (a larger block alone)."""
    out: list[list[tuple[int, int]]] = []
    for block in blocks:
        if out and block[1] - out[-1][0][0] <= piece_bytes:
            out[-1].append(block)
        else:
            out.append([block])
    return out


class PinnedRing:
    """Host buffers handed out round-robin, one per piece copied from a device. A slot is handed out again only
    once every hash of the piece it last held has finished: across the buckets of a digest and across digests,
    since the ring belongs to the hasher. (Per bucket is not enough: the next bucket's first piece would be
    copied into slot 0 while hashes of the previous bucket's pieces still wait in the pool to read it.)"""

    def __init__(self, buffers: list) -> None:
        self.buffers = buffers
        self._readers: list[list[Future]] = [[] for _ in buffers]
        self._next = 0

    def claim(self) -> int:
        """The next slot, once its last piece's hashes are done (blocks until then)."""
        slot = self._next
        self._next = (self._next + 1) % len(self.buffers)
        for f in self._readers[slot]:
            f.result()
        return slot

    def read_by(self, slot: int, readers: list[Future]) -> None:
        """`readers` hash what was just copied into `slot`: it is not handed out again before they finish."""
        self._readers[slot] = readers


class BucketHasher:
    """Keeps its thread pool and (for device buckets) its pinned ring between digests."""

    def __init__(self, threads: int | None = None, on: str = "host") -> None:
        if on not in DIGEST_ON:
            raise ValueError(f"weight_ipc_digest: {on!r} is not one of {list(DIGEST_ON)}")
        self.on = on
        self.pool = ThreadPoolExecutor(max_workers=threads or block_pool_threads(), thread_name_prefix="ipc-sha256")
        self._ring = PinnedRing([])
        self._ring_device: torch.device | None = None

    def warm(self, device: torch.device | str | None) -> None:
        """Before the first handover (at service start, or when a model is loaded on a GPU): allocate the pinned
        ring for buckets on `device` and, hashing on the device, compile its kernel, so that a run's first sync
        pays for neither. Nothing for a device that is not a GPU."""
        device = torch.device(device) if device is not None else None
        if device is None or device.type != "cuda":
            return
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._ring_for(device)
        if self.on == "device":
            from kernels.digest.sha256_blocks import digests_of, launch_tree_digests
            digests_of(launch_tree_digests(torch.zeros(DIGEST_BLOCK_BYTES, dtype=torch.uint8, device=device), [0],
                                           DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES))

    def _ring_for(self, device: torch.device) -> None:
        if self._ring_device != device:
            self._ring = PinnedRing([torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True)
                                     for _ in range(RING_PIECES)])
            self._ring_device = device

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._ring = PinnedRing([])
        self._ring_device = None

    def digest(self, buffers: Sequence[torch.Tensor], layouts: Sequence[BucketLayout]) -> str:
        """The weights digest of the layouts' tensors in order, read from `buffers` (flat uint8, one per layout)."""
        pending: list[Future | tuple[int, int]] = []  # per block in digest order: a host future, or (launch, row)
        launched: list[tuple[torch.Tensor, torch.cuda.Stream]] = []  # per device launch: its states, its stream
        on_device = [buffer.is_cuda and self.on == "device" for buffer in buffers]
        for buffer, layout, here in zip(buffers, layouts, on_device):  # every launch queued before any host work
            if here:
                whole = [a for a, b in block_ranges(layout) if b - a == DIGEST_BLOCK_BYTES]
                launched.append(self._launch(buffer, whole))
        launch = iter(range(len(launched)))
        for buffer, layout, here in zip(buffers, layouts, on_device):
            blocks = block_ranges(layout)
            if not buffer.is_cuda:
                host = memoryview(buffer.numpy())
                pending.extend(self.pool.submit(block_sha256, host[a:b]) for a, b in blocks)
            elif not here:
                pending.extend(self._device_blocks(buffer, blocks))
            else:
                which, rows = next(launch), itertools.count()  # the launch's rows: its whole blocks in order
                tails = iter(self._device_blocks(buffer, [(a, b) for a, b in blocks if b - a != DIGEST_BLOCK_BYTES]))
                pending.extend((which, next(rows)) if b - a == DIGEST_BLOCK_BYTES else next(tails) for a, b in blocks)
        device: list[list[bytes]] = []
        if launched:
            from kernels.digest.sha256_blocks import digests_of
            for states, stream in launched:
                stream.synchronize()
                device.append(digests_of(states))
        return digest_of_blocks(p.result() if isinstance(p, Future) else device[p[0]][p[1]] for p in pending)

    @staticmethod
    def _launch(buffer: torch.Tensor, starts: list[int]) -> tuple[torch.Tensor, torch.cuda.Stream]:
        """Queue the device hashing of the whole blocks at `starts` on a stream of the bucket's own."""
        from kernels.digest.sha256_blocks import launch_tree_digests
        stream = torch.cuda.Stream(buffer.device)
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        with torch.cuda.stream(stream):
            return launch_tree_digests(buffer, starts, DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES), stream

    def _device_blocks(self, buffer: torch.Tensor, blocks: list[tuple[int, int]]) -> list[Future]:
        if not blocks:
            return []
        self._ring_for(buffer.device)
        copier = torch.cuda.Stream(buffer.device)
        copier.wait_stream(torch.cuda.current_stream(buffer.device))  # what was written there before is in
        futures: list[Future] = []
        for group in pieces(blocks, PIECE_BYTES):
            slot = self._ring.claim()
            start, end = group[0][0], group[-1][1]
            host = self._ring.buffers[slot]
            with torch.cuda.stream(copier):
                host[:end - start].copy_(buffer[start:end], non_blocking=True)
                done = torch.cuda.Event()
                done.record(copier)
            view = memoryview(host.numpy())
            first = self.pool.submit(done.synchronize)
            piece = [self.pool.submit(_after, first, view, a - start, b - start) for a, b in group]
            self._ring.read_by(slot, piece)
            futures.extend(piece)
        return futures


def _after(ready: Future, view: memoryview, a: int, b: int) -> bytes:
    ready.result()
    return block_sha256(view[a:b])
