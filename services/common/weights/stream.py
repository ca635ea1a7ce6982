"""Chunked, checksummed weight streams (trainer GetWeights -> rollout UpdateWeights).

A sender cuts every tensor into chunks of at most `chunk_bytes`; each chunk
carries the digest of its bytes (digest.block_sha256: the sha256 of its 256 KiB
leaves' sha256s), and the last chunk carries the stream's digest
(services.common.weights.digest: sha256 over the digests of every tensor's
4 MiB blocks) plus the chunk count. At the default chunk size a chunk is one
digest block, so each byte is hashed once per side. The receiver verifies each
chunk as it arrives and the whole at the end, and only then hands out tensors;
a stream that fails any check yields nothing to apply. On the wire a chunk's
payload is written and read in place (services.common.weights.chunk_frames).

A LoRA adapter stream carries the adapter's rank, alpha and target modules on
every chunk (`WeightChunk.lora`); the assembler refuses a stream whose chunks
disagree on it, so a receiver never mistakes adapter tensors for model weights.
"""
from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from proto import lockstep_pb2 as pb
from services.common.tensors import dtype_from_name, dtype_name
from services.common.weights.chunk_frames import ChunkFrameError, split_chunk
from services.common.weights.digest import DIGEST_BLOCK_BYTES, BlockDigests, block_sha256, tensor_byte_view
from services.common.weights.finite_check import bytes_all_finite, checks_bytes

# One chunk per digest block: a chunk's digest is then its block's, and no byte is hashed twice.
DEFAULT_CHUNK_BYTES = DIGEST_BLOCK_BYTES
# The receiver hashes chunks at least this large on its worker threads (hashlib releases the GIL on large
# buffers), overlapping the receiving of the next chunks; smaller ones cost less inline than a hand-off.
PARALLEL_HASH_MIN_BYTES = 64 * 1024
# Receiver worker threads: one sha256 pass runs at about 1 GB/s per core, so a stream of several GB/s
# needs several; more than 8 gain nothing on the hosts measured (bench/weight_sync.py).
DEFAULT_RECEIVE_WORKERS = max(1, min(8, os.cpu_count() or 1))
# The finite check of a stored tensor runs in pieces of about this many bytes, spread over the workers.
FINITE_PIECE_BYTES = 4 * 1024 * 1024


class WeightStreamError(ValueError):
    """A weight stream failed validation; nothing from it may be applied."""


@dataclass(frozen=True)
class LoraAdapterMeta:
    """A LoRA adapter's shape: W = W0 + (alpha / rank) * B @ A on each target module."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_proto(self) -> pb.LoraAdapter:
        return pb.LoraAdapter(rank=self.rank, alpha=self.alpha, target_modules=list(self.target_modules))

    @staticmethod
    def from_proto(msg: pb.LoraAdapter) -> "LoraAdapterMeta":
        """Checked: a rank below 1, a non-finite or non-positive alpha or no target module is refused."""
        if msg.rank < 1:
            raise WeightStreamError(f"lora.rank: must be >= 1, got {msg.rank}")
        if not (math.isfinite(msg.alpha) and msg.alpha > 0):
            raise WeightStreamError(f"lora.alpha: must be finite and > 0, got {msg.alpha}")
        if not msg.target_modules or not all(msg.target_modules):
            raise WeightStreamError("lora.target_modules: must be non-empty names")
        return LoraAdapterMeta(rank=int(msg.rank), alpha=float(msg.alpha), target_modules=tuple(msg.target_modules))


def iter_weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    run_id: str,
    policy_version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    lora: LoraAdapterMeta | None = None,
) -> Iterator[pb.WeightChunk]:
    """The stream's definition, chunk by chunk, as parsed messages: what a client pushing UpdateWeights
    sends, and the reference the trainer's served versions (services/trainer/weights/served_weights.py) are
    tested against. `lora` marks the stream as that adapter's tensors (set on every chunk).
    `named_tensors` is consumed lazily, and each tensor is let go once its last chunk is cut."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    blocks = BlockDigests()
    pending: pb.WeightChunk | None = None
    count = 0
    for name, tensor in named_tensors:
        data = tensor_byte_view(tensor)
        dtype, shape = dtype_name(tensor.dtype), list(tensor.shape)
        del tensor
        for offset in range(0, max(len(data), 1), chunk_bytes):
            piece = data[offset : offset + chunk_bytes]
            digest = block_sha256(piece)
            blocks.add(name, offset, piece, len(data), digest)
            if pending is not None:
                yield pending
            pending = pb.WeightChunk(
                run_id=run_id,
                policy_version=policy_version,
                name=name,
                dtype=dtype,
                shape=shape,
                offset=offset,
                tensor_nbytes=len(data),
                data=piece.tobytes(),
                chunk_sha256=digest.hex(),
                lora=lora.to_proto() if lora is not None else None,
            )
            count += 1
        del data, piece
    if pending is None:
        raise ValueError("no tensors to send")
    pending.last = True
    pending.total_sha256 = blocks.hexdigest()
    pending.total_chunks = count
    yield pending


@dataclass
class _TensorBuffer:
    """One tensor being received: its bytes land in `data` (preallocated) in order."""

    dtype: torch.dtype
    meta: tuple[str, tuple[int, ...], int]
    data: torch.Tensor
    received: int = 0  # bytes announced by the chunks added so far
    stored: int = 0    # bytes verified and copied in, in order

    def __post_init__(self) -> None:
        self.view = self.data.numpy()  # the same bytes: numpy's copy releases the GIL


def _allocate(chunk: pb.WeightChunk, where: str, allocate: Callable[[int], torch.Tensor]) -> _TensorBuffer:
    """A buffer for the tensor `chunk` starts, after checking that its dtype, shape and byte size agree."""
    dtype = dtype_from_name(chunk.dtype, field=f"{where}.dtype")
    shape = tuple(int(d) for d in chunk.shape)
    if any(d < 0 for d in shape):
        raise WeightStreamError(f"{where}: negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if chunk.tensor_nbytes != expected:
        raise WeightStreamError(f"{where}: tensor_nbytes={chunk.tensor_nbytes} but shape {list(shape)} of "
                                f"{chunk.dtype} holds {expected} bytes")
    data = allocate(chunk.tensor_nbytes)
    if data.dtype != torch.uint8 or data.shape != (chunk.tensor_nbytes,) or data.device.type != "cpu":
        raise RuntimeError(f"allocate({chunk.tensor_nbytes}) returned {data.dtype} {tuple(data.shape)} on "
                           f"{data.device}, not that many uint8 bytes in host memory")
    return _TensorBuffer(dtype, (chunk.dtype, shape, chunk.tensor_nbytes), data)


def _new_host_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _verify_and_store(where: str, data: bytes | memoryview, expected: str, tensor: _TensorBuffer,
                      start: int) -> bytes | str:
    """One chunk's hash and, if it matches, its copy into the tensor's buffer: the digest, or the error."""
    digest = block_sha256(data)
    if digest.hex() != expected:
        return f"{where}: chunk_sha256 mismatch"
    tensor.view[start : start + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return digest


def finite_pieces(nbytes: int, itemsize: int) -> list[tuple[int, int]]:
    """Byte spans of about FINITE_PIECE_BYTES covering [0, nbytes), each a whole number of values."""
    step = max(itemsize, FINITE_PIECE_BYTES // itemsize * itemsize)
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def _finite_piece(name: str, data: np.ndarray, dtype: torch.dtype) -> str | None:
    return None if bytes_all_finite(data, dtype) else f"{name}: non-finite values"


@dataclass
class _ChunkJob:
    """A received chunk waiting for its hash (and copy) on a worker: its outcome is its sha256 digest,
    or the error that refuses the stream."""

    name: str
    start: int
    data: bytes | memoryview
    tensor: _TensorBuffer
    outcome: Future


class WeightStreamAssembler:
    """Consumes chunks in order (`add` a parsed WeightChunk, `add_raw` its encoding); `finish()` returns the
    verified tensors.

    Each chunk is hashed and copied into its tensor's buffer on a pool of `workers` threads (hashlib and
    numpy's copy release the GIL) while the chunks that follow are received; at most 2 x `workers` chunks
    wait for it. Outcomes are taken in arrival order: each verified digest is also its digest block's
    (services.common.weights.digest), from which the whole stream's digest is derived. With `check_finite`
    every floating tensor, once stored, is checked for NaN and infinities on the pool too, in pieces;
    `finite_checked` then tells the engine it need not check again. A mismatch found on the pool is
    raised by the next add() (the last chunk's add() waits for everything). `allocate(nbytes)` gives each
    tensor's receive buffer (host uint8; a StagingArena's lease keeps them between syncs).
    After any refused chunk the assembler is spent: every later call raises, so a caller that carries on
    past an error still cannot apply anything."""

    def __init__(self, *, workers: int = DEFAULT_RECEIVE_WORKERS, check_finite: bool = False,
                 allocate: Callable[[int], torch.Tensor] = _new_host_bytes) -> None:
        if workers < 1:
            raise ValueError(f"workers: must be >= 1, got {workers}")
        self._workers, self._check_finite, self._allocate_bytes = workers, check_finite, allocate
        self._blocks = BlockDigests()
        self._tensors: dict[str, _TensorBuffer] = {}
        self._count = 0
        self._done = False
        self._failed: str | None = None
        self.run_id: str | None = None
        self.policy_version: int | None = None
        self.lora: LoraAdapterMeta | None = None
        self._lora_proto: bytes | None = None
        self._nbytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._unstored: deque[_ChunkJob] = deque()
        self._finite_checks: list[Future] = []

    @property
    def finite_checked(self) -> bool:
        """Whether every floating tensor of the finished stream was checked finite here."""
        return self._check_finite and self._done and self._failed is None

    def add(self, chunk: pb.WeightChunk) -> None:
        self._guarded(self._add, chunk, chunk.data)  # each read of a bytes field copies it: read once

    def add_raw(self, raw: bytes) -> None:
        """One chunk as received (its serialized WeightChunk): the payload is hashed and copied from the
        message itself, never copied out of it first."""
        def split_and_add() -> None:
            try:
                header, data = split_chunk(raw)
            except ChunkFrameError as exc:
                raise WeightStreamError(f"chunk {self._count}: {exc}") from None
            self._add(header, data)

        self._guarded(split_and_add)

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        if self._failed is not None:
            raise WeightStreamError(f"stream already refused: {self._failed}")
        try:
            fn(*args)
        except (WeightStreamError, ValueError) as exc:
            self._failed = str(exc)
            self._stop_pool()
            raise WeightStreamError(str(exc)) from None

    def _add(self, chunk: pb.WeightChunk, data: bytes | memoryview) -> None:
        if self._done:
            raise WeightStreamError("chunk received after the last chunk")
        where = f"chunk {self._count} ({chunk.name!r})"
        if self.policy_version is None:
            self.policy_version, self.run_id = chunk.policy_version, chunk.run_id
        elif chunk.policy_version != self.policy_version or chunk.run_id != self.run_id:
            raise WeightStreamError(f"{where}: policy_version/run_id changed mid-stream")
        lora_proto = chunk.lora.SerializeToString(deterministic=True) if chunk.HasField("lora") else b""
        if self._count == 0:
            self._lora_proto = lora_proto
            self.lora = LoraAdapterMeta.from_proto(chunk.lora) if chunk.HasField("lora") else None
        elif lora_proto != self._lora_proto:
            raise WeightStreamError(f"{where}: lora adapter metadata changed mid-stream")
        if not chunk.name:
            raise WeightStreamError(f"{where}: name is empty")
        tensor = self._tensors.get(chunk.name)
        if tensor is None:
            tensor = self._tensors[chunk.name] = _allocate(chunk, where, self._allocate_bytes)
        elif tensor.meta != (chunk.dtype, tuple(chunk.shape), chunk.tensor_nbytes):
            raise WeightStreamError(f"{where}: dtype/shape changed between chunks of one tensor")
        start, end = tensor.received, tensor.received + len(data)
        if chunk.offset != start:
            raise WeightStreamError(f"{where}: offset {chunk.offset} but {start} bytes received")
        if end > chunk.tensor_nbytes:
            raise WeightStreamError(f"{where}: more bytes than tensor_nbytes={chunk.tensor_nbytes}")
        tensor.received = end
        self._count += 1
        self._nbytes += len(data)
        args = (where, data, chunk.chunk_sha256, tensor, start)
        if len(data) >= PARALLEL_HASH_MIN_BYTES:
            outcome = self._pool_submit(_verify_and_store, *args)
        else:  # cheaper inline than handed off
            outcome = Future()
            outcome.set_result(_verify_and_store(*args))
        self._unstored.append(_ChunkJob(chunk.name, start, data, tensor, outcome))
        self._collect(wait_until=2 * self._workers)
        if chunk.last:
            self._done = True
            self._collect(wait_until=0)
            errors = [e for e in (f.result() for f in self._finite_checks) if e is not None]
            self._stop_pool()
            if errors:
                more = f" (+{len(errors) - 8} more)" if len(errors) > 8 else ""
                raise WeightStreamError("; ".join(errors[:8]) + more)
            if chunk.total_chunks != self._count:
                raise WeightStreamError(f"stream held {self._count} chunks, last chunk says {chunk.total_chunks}")
            if chunk.total_sha256 != self._blocks.hexdigest():
                raise WeightStreamError("total_sha256 mismatch over the whole stream")

    def _pool_submit(self, fn: Callable[..., object], *args: object) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._workers, thread_name_prefix="weight-receive")
        return self._pool.submit(fn, *args)

    def _collect(self, *, wait_until: int) -> None:
        """Take the outcomes in order: raise the first refusal; record each verified digest; start the
        finite check of each tensor whose bytes are all stored. Waits until at most `wait_until` chunks
        are outstanding."""
        while self._unstored and (self._unstored[0].outcome.done() or len(self._unstored) > wait_until):
            job = self._unstored.popleft()
            outcome = job.outcome.result()
            if isinstance(outcome, str):
                raise WeightStreamError(outcome)
            nbytes = job.tensor.meta[2]
            self._blocks.add(job.name, job.start, job.data, nbytes, outcome)
            job.tensor.stored += len(job.data)
            if job.tensor.stored == nbytes and self._check_finite and checks_bytes(job.tensor.dtype):
                self._finite_checks += [self._pool_submit(_finite_piece, job.name, job.tensor.view[a:b], job.tensor.dtype)
                                        for a, b in finite_pieces(nbytes, job.tensor.dtype.itemsize)]

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._unstored.clear()

    def finish(self) -> dict[str, torch.Tensor]:
        """The tensors (views of the receive buffers, no copy), once the whole stream has verified."""
        if self._failed is not None:
            raise WeightStreamError(f"stream already refused: {self._failed}")
        if not self._done:
            raise WeightStreamError("stream ended before its last chunk")
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self._tensors.items():
            _, shape, nbytes = tensor.meta
            if tensor.received != nbytes:
                raise WeightStreamError(f"{name}: received {tensor.received} of {nbytes} bytes")
            out[name] = tensor.data.view(tensor.dtype).reshape(shape)
        return out

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def total_sha256(self) -> str:
        """The stream's digest, once its last chunk has verified against it."""
        if not self._done or self._failed is not None:
            raise WeightStreamError("stream ended before its last chunk")
        return self._blocks.hexdigest()
