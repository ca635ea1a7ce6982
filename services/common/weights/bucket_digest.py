"""The weights digest (services/common/weights/digest.py) of tensors packed in buckets, on either side of an
IPC handover: the trainer over the buckets it shares, the replica over what it mapped.

Work is one digest block (a tensor's 4 MiB piece, digest.block_sha256), hashed on a thread pool (hashlib
releases the GIL). Buckets in host memory are hashed where they lie. Device buckets are copied to the host in
pieces of up to PIECE_BYTES (whole blocks) through a small ring of pinned buffers on a stream of their own, so
the copy of one piece overlaps the hashing of the ones before: the ring is allocated at the first use and kept
by its BucketHasher, and is small (RING_PIECES x PIECE_BYTES), so a first sync pays little more than a later
one.

`on="device"` hashes every whole 256 KiB leaf of a device bucket on the device instead (kernels/digest: one
lane per leaf, each bucket's launch on a stream of its own). A tensor's last block usually ends in a shorter
leaf: those are gathered back to back on the device (one copy, not one per tensor, and never the bytes between
them) and hashed on the host, where each block's digest is then made from its 32-byte leaf digests. The same
digest, without copying most bytes to the host or spending every core on them. Buckets in host memory are
hashed on the host whatever `on` says.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.common.weights.digest import (DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES, block_pool_threads, block_sha256,
                                            block_spans, digest_of_blocks)
from services.common.weights.ipc_transport import BucketLayout, TensorSlot

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


def leaf_plan(layout: BucketLayout) -> list[tuple[list[int], tuple[int, int] | None]]:
    """Pure. Per digest block of the layout, in digest order: the bucket offsets of its whole leaves, and the
    span of its last leaf when that one is shorter (None when every leaf is whole; an empty block is one empty
    leaf, so it gets an empty span)."""
    out: list[tuple[list[int], tuple[int, int] | None]] = []
    for a, b in block_ranges(layout):
        cut = a + (b - a) // DIGEST_LEAF_BYTES * DIGEST_LEAF_BYTES
        out.append((list(range(a, cut, DIGEST_LEAF_BYTES)), (cut, b) if cut < b or a == b else None))
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
        # One small digest the way a handover's runs (a whole leaf, a shorter one): compiles the kernel and loads
        # every kernel the path uses (CUDA loads a module at its first launch), so none is paid in a sync.
        sizes = (DIGEST_LEAF_BYTES + 512,)
        layout = BucketLayout((TensorSlot("warm", "uint8", sizes, 0, sizes[0]),), sizes[0])
        self.digest([torch.zeros(sizes[0], dtype=torch.uint8, device=device)], [layout])

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
        on_device = [buffer.is_cuda and self.on == "device" for buffer in buffers]
        # Every device launch is queued before any host work, so the GPU hashes while the host copies.
        launched = iter([self._launch(buffer, leaf_plan(layout)) for buffer, layout, here
                         in zip(buffers, layouts, on_device) if here])
        pending: list[Future | tuple[_Launched, list[tuple[list[int], Future | None]]]] = []
        for buffer, layout, here in zip(buffers, layouts, on_device):
            blocks = block_ranges(layout)
            if not buffer.is_cuda:
                host = memoryview(buffer.numpy())
                pending.extend(self.pool.submit(block_sha256, host[a:b]) for a, b in blocks)
            elif not here:
                pending.extend(self._device_blocks(buffer, blocks, block_sha256, None))
            else:
                pending.append(self._finish_launch(next(launched)))
        out: list[bytes] = []
        for p in pending:
            if isinstance(p, Future):
                out.append(p.result())
                continue
            from kernels.digest.sha256_blocks import digests_of  # only with a GPU: Triton is imported then
            launch, blocks = p
            launch.stream.synchronize()
            leaves = iter(digests_of(launch.states))
            out.extend(hashlib.sha256(b"".join([*(next(leaves) for _ in whole),
                                                *([last.result()] if last is not None else [])])).digest()
                       for whole, last in blocks)
        return digest_of_blocks(out)

    @staticmethod
    def _launch(buffer: torch.Tensor, plan: list[tuple[list[int], tuple[int, int] | None]]) -> "_Launched":
        """Queue, on a stream of the bucket's own, the hashing of every whole leaf and the gathering of every
        shorter last leaf into one device buffer (copied to the host in few pieces, not one per tensor)."""
        from kernels.digest.sha256_blocks import launch_sha256_blocks
        stream = torch.cuda.Stream(buffer.device)
        stream.wait_stream(torch.cuda.current_stream(buffer.device))
        short = [span for _, span in plan if span is not None]
        with torch.cuda.stream(stream):
            states = launch_sha256_blocks(buffer, [s for whole, _ in plan for s in whole], DIGEST_LEAF_BYTES)
            gathered = torch.cat([buffer[a:b] for a, b in short]) if short else buffer[:0]
        return _Launched(plan, states, gathered, stream)

    def _finish_launch(self, launch: "_Launched") -> tuple["_Launched", list[tuple[list[int], Future | None]]]:
        """Hash the launch's shorter leaves on the host (plain sha256: each is a leaf); per block, its whole
        leaves and the future of its last, shorter one."""
        spans, offset = [], 0
        for _, span in launch.plan:
            if span is not None:
                spans.append((offset, offset + span[1] - span[0]))
                offset += span[1] - span[0]
        hashed = iter(self._device_blocks(launch.gathered, spans, _leaf_sha256, launch.stream))
        return launch, [(whole, next(hashed) if span is not None else None) for whole, span in launch.plan]

    def _device_blocks(self, buffer: torch.Tensor, blocks: list[tuple[int, int]], hash_fn,
                       after: torch.cuda.Stream | None) -> list[Future]:
        """`hash_fn` of each span of a device buffer, copied to the host through the pinned ring, once the
        work queued on `after` (default: the current stream) is done."""
        if not blocks:
            return []
        self._ring_for(buffer.device)
        copier = torch.cuda.Stream(buffer.device)
        copier.wait_stream(after or torch.cuda.current_stream(buffer.device))  # what was written there is in
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
            piece = [self.pool.submit(_after, first, hash_fn, view, a - start, b - start) for a, b in group]
            self._ring.read_by(slot, piece)
            futures.extend(piece)
        return futures


@dataclass
class _Launched:
    """One device bucket's queued digest work: its leaf plan, the whole leaves' sha256 states, its shorter
    leaves gathered back to back, and the stream all of it runs on."""

    plan: list[tuple[list[int], tuple[int, int] | None]]
    states: torch.Tensor
    gathered: torch.Tensor
    stream: torch.cuda.Stream


def _leaf_sha256(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()


def _after(ready: Future, hash_fn, view: memoryview, a: int, b: int) -> bytes:
    ready.result()
    return hash_fn(view[a:b])
