"""The trainer's side of the GetWeights stream: one weights state cut once into host memory and served,
chunk by chunk, to every replica that reads it.

Cutting a version copies every tensor (the compute-dtype cast forward runs on) into one host buffer, in
pinned memory when the tensors are on a GPU, so the device-to-host copies are one pass at the link's
rate; the snapshot is then immutable, whatever later steps do to the live weights. The chunks' sha256
digests (each a digest block of services.common.weights.digest) are computed on a pool of threads from
the moment the first reader opens (never for a version only written to a directory, which is hashed as
it is written); each reader's chunks are encoded (services.common.weights.chunk_frames: the payload copied once,
from the buffer) on a second pool, a few ahead of the one being sent. The digests are kept for the
version, so a second replica costs one copy per byte and no hashing. The buffer also backs a
WriteWeights directory (`tensors()`), written while the live weights move on.

A holder (a reader, a directory being written) keeps the buffer: a later cut takes it over only when none
is left, and a version whose buffer was taken refuses new holders (VersionRetired).
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from proto import lockstep_pb2 as pb
from services.common.tensors import dtype_name
from services.common.weights.chunk_frames import encode_chunk
from services.common.weights.digest import BlockDigests, block_sha256
from services.common.weights.stream import LoraAdapterMeta

# Threads hashing and encoding chunks; sha256 runs at about 1 GB/s per core.
DEFAULT_CUT_WORKERS = max(1, min(8, os.cpu_count() or 1))
# Chunks a reader has encoded ahead of the one it sends: enough to keep every worker busy.
ENCODE_AHEAD = 2 * DEFAULT_CUT_WORKERS
# Each tensor starts at a multiple of this in the host buffer, so a slice views as any dtype.
_ALIGN = 64


class VersionRetired(RuntimeError):
    """The version's host buffer was taken over by a later cut: it holds that cut's bytes now."""


@dataclass(frozen=True)
class _Chunk:
    name: str
    dtype: str
    shape: tuple[int, ...]
    tensor_nbytes: int
    offset: int   # within the tensor
    start: int    # within the host buffer
    length: int


class WeightVersion:
    """One weights state in host memory, with its chunk table and the chunks' digests (being computed)."""

    def __init__(self, named_tensors: Sequence[tuple[str, torch.Tensor]], *, run_id: str, policy_version: int,
                 chunk_bytes: int, lora: LoraAdapterMeta | None, hash_pool: ThreadPoolExecutor,
                 encode_pool: ThreadPoolExecutor, reuse: "WeightVersion | None" = None) -> None:
        """`reuse`: the version this one replaces; its host buffer is written over when no reader holds it
        and it is large enough and of the same kind (new memory costs a page fault per page on first
        write, and pinning a buffer costs more than copying into it)."""
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: must be positive, got {chunk_bytes}")
        if not named_tensors:
            raise ValueError("no tensors to send")
        self.run_id, self.policy_version, self.lora = run_id, policy_version, lora
        self.chunk_bytes, self._encode_pool = chunk_bytes, encode_pool
        layout, total = [], 0
        for name, t in named_tensors:
            layout.append((name, t, total))
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        pin = any(t.device.type != "cpu" for _, t in named_tensors) and torch.cuda.is_available()
        taken = reuse._take_buffer(total, pin) if reuse is not None else None
        self.buffer = taken if taken is not None else torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self._holders_lock = threading.Lock()
        self.readers = 0  # holders (open VersionReaders, directories being written): the buffer is not reused
        self._retired = False
        self._chunks: list[_Chunk] = []
        self._tensors: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []  # name, dtype, shape, start, nbytes
        for name, t, start in layout:
            nbytes = t.numel() * t.element_size()
            self._tensors.append((name, t.dtype, tuple(t.shape), start, nbytes))
            if nbytes:
                self.buffer[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
            for offset in range(0, max(nbytes, 1), chunk_bytes):
                self._chunks.append(_Chunk(name, dtype_name(t.dtype), tuple(t.shape), nbytes, offset,
                                           start + offset, min(chunk_bytes, nbytes - offset)))
        if pin:
            torch.cuda.synchronize()  # the snapshot is whole before the caller lets the weights change
        self._view = memoryview(self.buffer.numpy())
        self.nbytes = sum(c.length for c in self._chunks)
        # Hashed in chunk order on their own pool, from the first reader on (a version only written to a
        # directory is hashed there, as it is written): a reader's encoding (on the other pool) of chunk i
        # waits only for the digests up to i, not behind the whole version's hashing.
        self._hash_pool = hash_pool
        self._digests: list[Future[bytes]] | None = None
        self._hashing_lock = threading.Lock()
        self._total: str | None = None

    def __len__(self) -> int:
        return len(self._chunks)

    def _take_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor | None:
        """This version's buffer for a new cut of `nbytes`, if no one holds it and it fits; it is retired then."""
        with self._holders_lock:
            if self.readers or self._retired or self.buffer.numel() < nbytes or self.buffer.is_pinned() != pinned:
                return None
            self._retired = True
            buffer, self.buffer, self._view = self.buffer, torch.empty(0, dtype=torch.uint8), memoryview(b"")
            return buffer

    def acquire(self) -> None:
        """Become a holder; VersionRetired if a later cut took the buffer over."""
        with self._holders_lock:
            if self._retired:
                raise VersionRetired(f"policy_version {self.policy_version}: its host copy was reused by a later one")
            self.readers += 1

    def release(self) -> None:
        with self._holders_lock:
            self.readers -= 1

    @contextlib.contextmanager
    def held(self) -> Iterator["WeightVersion"]:
        self.acquire()
        try:
            yield self
        finally:
            self.release()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The snapshot's tensors, views of the host buffer (valid while held)."""
        return [(name, self.buffer[start:start + nbytes].view(dtype).view(shape))
                for name, dtype, shape, start, nbytes in self._tensors]

    def _data(self, c: _Chunk) -> memoryview:
        return self._view[c.start:c.start + c.length]

    def _hash(self, c: _Chunk) -> bytes:
        return block_sha256(self._data(c))

    def _hashes(self) -> list[Future[bytes]]:
        """The chunks' digests, submitted to the pool on the first call."""
        with self._hashing_lock:
            if self._digests is None:
                self._digests = [self._hash_pool.submit(self._hash, c) for c in self._chunks]
            return self._digests

    def total_sha256(self) -> str:
        """The weights' digest (waits for every chunk's)."""
        if self._total is None:
            blocks = BlockDigests()  # a chunk that is one digest block brings its digest; others are re-cut
            for c, digest in zip(self._chunks, self._hashes()):
                blocks.add(c.name, c.offset, self._data(c), c.tensor_nbytes, digest.result())
            self._total = blocks.hexdigest()
        return self._total

    def encode(self, index: int) -> bytes:
        """Chunk `index` as sent (a serialized WeightChunk)."""
        c = self._chunks[index]
        header = pb.WeightChunk(
            run_id=self.run_id, policy_version=self.policy_version, name=c.name, dtype=c.dtype,
            shape=list(c.shape), offset=c.offset, tensor_nbytes=c.tensor_nbytes,
            chunk_sha256=self._hashes()[index].result().hex(),
            lora=self.lora.to_proto() if self.lora is not None else None,
        )
        if index == len(self._chunks) - 1:
            header.last, header.total_sha256, header.total_chunks = True, self.total_sha256(), len(self._chunks)
        return encode_chunk(header, self._data(c))

    def reader(self, ahead: int = ENCODE_AHEAD) -> "VersionReader":
        return VersionReader(self, ahead)


class VersionReader:
    """One GetWeights stream over a version: `next_chunk()` gives the chunks in order, each encoded on the
    pool while earlier ones are sent, at most `ahead` of them in flight."""

    def __init__(self, version: WeightVersion, ahead: int) -> None:
        self._version, self._ahead = version, max(1, ahead)
        self._submitted = 0
        self._pending: list[Future[bytes]] = []
        version.acquire()
        version._hashes()
        self._open = True

    def next_chunk(self) -> Future[bytes] | None:
        """The future of the next chunk's bytes, or None after the last."""
        while self._submitted < len(self._version) and len(self._pending) < self._ahead:
            self._pending.append(self._version._encode_pool.submit(self._version.encode, self._submitted))
            self._submitted += 1
        return self._pending.pop(0) if self._pending else None

    def close(self) -> None:
        for f in self._pending:
            f.cancel()
        for f in self._pending:  # an encode already running still reads the buffer: let it finish
            if not f.cancelled():
                f.exception()
        self._pending.clear()
        if self._open:
            self._open = False
            self._version.release()
