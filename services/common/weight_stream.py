"""Chunked, checksummed weight streams (trainer GetWeights -> rollout UpdateWeights).

A sender cuts every tensor into chunks of at most `chunk_bytes`; each chunk
carries the sha256 of its bytes, and the last chunk carries the sha256 of all
chunk bytes in order plus the chunk count. The receiver verifies each chunk as
it arrives and the whole at the end, and only then hands out tensors; a stream
that fails any check yields nothing to apply.

A LoRA adapter stream carries the adapter's rank, alpha and target modules on
every chunk (`WeightChunk.lora`); the assembler refuses a stream whose chunks
disagree on it, so a receiver never mistakes adapter tensors for model weights.
"""
from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from proto import lockstep_pb2 as pb
from services.common.tensors import dtype_from_name, dtype_name

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# Chunks at least this large hash their own digest on a second thread while the stream digest is updated
# (hashlib releases the GIL on large buffers): the two sha256 passes per byte then run in parallel.
PARALLEL_HASH_MIN_BYTES = 1 << 20


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


def _tensor_byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw little-endian bytes as a flat view (one copy only if it is not contiguous on CPU)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


class _ParallelSha256:
    """sha256 of one buffer on a helper thread; `hexdigest()` joins it. Small buffers hash inline."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._digest = ""
        self._thread: threading.Thread | None = None
        if len(data) >= PARALLEL_HASH_MIN_BYTES:
            self._thread = threading.Thread(target=self._run, args=(data,), name="sha256-chunk", daemon=True)
            self._thread.start()
        else:
            self._run(data)

    def _run(self, data: bytes | memoryview) -> None:
        self._digest = hashlib.sha256(data).hexdigest()

    def hexdigest(self) -> str:
        if self._thread is not None:
            self._thread.join()
        return self._digest


def iter_weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    run_id: str,
    policy_version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    lora: LoraAdapterMeta | None = None,
) -> Iterator[pb.WeightChunk]:
    """`lora` marks the stream as that adapter's tensors (set on every chunk)."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    total = hashlib.sha256()
    pending: pb.WeightChunk | None = None
    count = 0
    for name, tensor in named_tensors:
        data = _tensor_byte_view(tensor)
        for offset in range(0, max(len(data), 1), chunk_bytes):
            piece = data[offset : offset + chunk_bytes]
            chunk_digest = _ParallelSha256(piece)
            total.update(piece)
            if pending is not None:
                yield pending
            pending = pb.WeightChunk(
                run_id=run_id,
                policy_version=policy_version,
                name=name,
                dtype=dtype_name(tensor.dtype),
                shape=list(tensor.shape),
                offset=offset,
                tensor_nbytes=len(data),
                data=piece.tobytes(),
                chunk_sha256=chunk_digest.hexdigest(),
                lora=lora.to_proto() if lora is not None else None,
            )
            count += 1
    if pending is None:
        raise ValueError("no tensors to send")
    pending.last = True
    pending.total_sha256 = total.hexdigest()
    pending.total_chunks = count
    yield pending


@dataclass
class _TensorBuffer:
    """One tensor being received: its bytes land in `data` (preallocated) in order."""

    dtype: torch.dtype
    meta: tuple[str, tuple[int, ...], int]
    data: torch.Tensor
    received: int = 0


def _allocate(chunk: pb.WeightChunk, where: str) -> _TensorBuffer:
    """A buffer for the tensor `chunk` starts, after checking that its dtype, shape and byte size agree."""
    dtype = dtype_from_name(chunk.dtype, field=f"{where}.dtype")
    shape = tuple(int(d) for d in chunk.shape)
    if any(d < 0 for d in shape):
        raise WeightStreamError(f"{where}: negative dimension in shape {list(shape)}")
    expected = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if chunk.tensor_nbytes != expected:
        raise WeightStreamError(f"{where}: tensor_nbytes={chunk.tensor_nbytes} but shape {list(shape)} of "
                                f"{chunk.dtype} holds {expected} bytes")
    return _TensorBuffer(dtype, (chunk.dtype, shape, chunk.tensor_nbytes),
                         torch.empty(chunk.tensor_nbytes, dtype=torch.uint8))


class WeightStreamAssembler:
    """Consumes chunks in order; `finish()` returns the verified tensors.

    After any refused chunk the assembler is spent: every later call raises, so a caller that carries on
    past an error still cannot apply anything."""

    def __init__(self) -> None:
        self._total = hashlib.sha256()
        self._tensors: dict[str, _TensorBuffer] = {}
        self._count = 0
        self._done = False
        self._failed: str | None = None
        self.run_id: str | None = None
        self.policy_version: int | None = None
        self.lora: LoraAdapterMeta | None = None
        self._lora_proto: bytes | None = None
        self._nbytes = 0

    def add(self, chunk: pb.WeightChunk) -> None:
        if self._failed is not None:
            raise WeightStreamError(f"stream already refused: {self._failed}")
        try:
            self._add(chunk)
        except (WeightStreamError, ValueError) as exc:
            self._failed = str(exc)
            raise WeightStreamError(str(exc)) from None

    def _add(self, chunk: pb.WeightChunk) -> None:
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
            tensor = self._tensors[chunk.name] = _allocate(chunk, where)
        elif tensor.meta != (chunk.dtype, tuple(chunk.shape), chunk.tensor_nbytes):
            raise WeightStreamError(f"{where}: dtype/shape changed between chunks of one tensor")
        if chunk.offset != tensor.received:
            raise WeightStreamError(f"{where}: offset {chunk.offset} but {tensor.received} bytes received")
        end = tensor.received + len(chunk.data)
        if end > chunk.tensor_nbytes:
            raise WeightStreamError(f"{where}: more bytes than tensor_nbytes={chunk.tensor_nbytes}")
        chunk_digest = _ParallelSha256(chunk.data)
        self._total.update(chunk.data)
        if chunk_digest.hexdigest() != chunk.chunk_sha256:
            raise WeightStreamError(f"{where}: chunk_sha256 mismatch")
        tensor.data.numpy()[tensor.received:end] = np.frombuffer(chunk.data, dtype=np.uint8)
        tensor.received = end
        self._count += 1
        self._nbytes += len(chunk.data)
        if chunk.last:
            self._done = True
            if chunk.total_chunks != self._count:
                raise WeightStreamError(f"stream held {self._count} chunks, last chunk says {chunk.total_chunks}")
            if chunk.total_sha256 != self._total.hexdigest():
                raise WeightStreamError("total_sha256 mismatch over the whole stream")

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
        return self._total.hexdigest()
