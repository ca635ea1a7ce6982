"""Shared-path weight source: the trainer writes one policy version as a safetensors directory, a replica
on a host that sees the same path reads it back.

The directory is a complete model directory: the run's model's other files (config, tokenizer) copied
beside `model.safetensors`, so an engine that loads model directories itself (SGLang's
/update_weights_from_disk) loads it in place. The weight file's metadata records the policy version and the
order the tensors stream in; the data lies in that order. Its digest is services.common.weights.digest's over
the tensors in that order: exactly the total_sha256 of the GetWeights stream of the same weights (both are
defined over each tensor's bytes in fixed blocks, however the stream is chunked), so a replica reports one
digest per version whichever source it read.

Each side moves every byte once and hashes it while it moves, on a pool of one thread per CPU:
- the writer writes each digest block from the tensor's own memory (from pinned staging buffers filled by
  asynchronous device-to-host copies when the tensors are on a GPU) while pool threads hash the blocks; the
  digest is over the bytes written;
- the reader's pool threads each read one block with pread into the tensor it returns, then hash it and
  check it finite (floating dtypes, by their exponent bits): the bytes returned are exactly the bytes hashed
  and checked. The header is parsed and checked in full first (services.common.weights.safetensors_layout); a file
  whose layout, version or digest disagrees applies nothing. Whether the values are finite is told to the
  engine by the type returned (FiniteTensors), which then does not check them again; it refuses them otherwise.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.weights.digest import (
    DIGEST_BLOCK_BYTES,
    block_pool_threads,
    block_sha256,
    block_spans,
    digest_of_blocks,
    tensor_byte_view,
)
from services.common.weights.finite_check import FiniteTensors, bytes_all_finite, checks_bytes
from services.common.weights.safetensors_layout import (
    HEADER_LENGTH_BYTES,
    SafetensorsLayoutError,
    TensorSpan,
    encode_header,
    header_length,
    parse_header,
)

WEIGHTS_FILE = "model.safetensors"
# The base model's files that are weights (or their index) and are therefore not copied.
BASE_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
BASE_WEIGHT_INDEX = "model.safetensors.index.json"
VERSION_KEY = "lockstep.policy_version"
ORDER_KEY = "lockstep.tensor_order"
# Tensors off the CPU are copied to the host through this many pinned buffers of this size: one is written
# and hashed while the next ones are being filled by the device.
STAGING_BUFFER_BYTES = 64 * 1024 * 1024
STAGING_BUFFERS = 3


class WeightFilesError(ValueError):
    """A weight directory that is missing, malformed, of another version or fails its digest."""


@dataclass(frozen=True)
class WeightFiles:
    directory: Path
    policy_version: int
    tensors: int
    nbytes: int
    total_sha256: str


@contextlib.contextmanager
def staged_model_dir(final: Path, base_dir: str | Path) -> Iterator[Path]:
    """A staging directory beside `final`, holding base_dir's files other than weights (config, tokenizer,
    generation config); the block writes the weights into it. Renamed to `final` when the block ends and
    removed if it raises, so a reader never sees a half-written model directory. `final` must not exist."""
    staging = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for f in Path(base_dir).iterdir():
            if f.is_file() and not f.name.endswith(BASE_WEIGHT_SUFFIXES) and f.name != BASE_WEIGHT_INDEX:
                shutil.copy2(f, staging / f.name)
        yield staging
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# ------------------------------------------------------------------ writer --


def write_weight_dir(directory: str | Path, named_tensors: list[tuple[str, torch.Tensor]],
                     policy_version: int, base_dir: str | Path, *, threads: int | None = None) -> WeightFiles:
    """Write the tensors (stream order) and base_dir's non-weight files as `directory`; it must not exist.
    Written beside it and renamed into place, so a reader never sees a half-written directory. Names that
    alias one tensor are written once each."""
    final = Path(directory)
    if final.exists():
        raise WeightFilesError(f"directory: {str(final)!r} already exists (one directory per version)")
    names = [n for n, _ in named_tensors]
    if not names or len(set(names)) != len(names):
        raise WeightFilesError("tensors: need at least one, each name once")
    tensors = [t.detach() for _, t in named_tensors]
    for name, t in zip(names, tensors):
        if t.layout != torch.strided:
            raise WeightFilesError(f"tensors[{name!r}]: a {t.layout} tensor; only dense tensors are written")
    metadata = {VERSION_KEY: str(int(policy_version)), ORDER_KEY: json.dumps(names)}
    try:
        prefix, _ = encode_header([(n, t.dtype, tuple(t.shape)) for n, t in zip(names, tensors)], metadata)
    except SafetensorsLayoutError as exc:
        raise WeightFilesError(str(exc)) from None
    with staged_model_dir(final, base_dir) as staging, \
            ThreadPoolExecutor(threads or block_pool_threads(), thread_name_prefix="weights-write") as pool:
        with open(staging / WEIGHTS_FILE, "wb", buffering=0) as f:
            _write_fully(f, memoryview(prefix))
            digests = write_tensor_data(f, tensors, pool)
        digest = digest_of_blocks(d.result() for d in digests)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return WeightFiles(final, int(policy_version), len(names), nbytes, digest)


def write_tensor_data(f, tensors: list[torch.Tensor], pool: ThreadPoolExecutor, *, staged: bool | None = None,
                      staging_bytes: int = STAGING_BUFFER_BYTES) -> list[Future]:
    """Write the tensors' bytes one after another to `f`; the futures of their block digests, in order.

    Tensors all on the CPU are written from their own memory (a non-contiguous one is copied once first);
    otherwise (or when `staged`) through staging buffers, pinned when a tensor is on a GPU."""
    if staged is None:
        staged = any(t.device.type != "cpu" for t in tensors)
    if staged:
        return _write_staged(f, tensors, pool, max(staging_bytes, DIGEST_BLOCK_BYTES))
    digests: list[Future] = []
    for t in tensors:
        view = tensor_byte_view(t)
        blocks = [view[o:o + DIGEST_BLOCK_BYTES] for o in block_spans(len(view))]
        digests.extend(pool.submit(block_sha256, b) for b in blocks)
        for block in blocks:
            _write_fully(f, block)
    return digests


@dataclass(frozen=True)
class _Segment:
    """Bytes [offset, offset + length) of tensor `tensor`, at `position` in a staging buffer; `blocks` are
    the (position, length) of its digest blocks in that buffer."""

    tensor: int
    offset: int
    length: int
    position: int
    blocks: tuple[tuple[int, int], ...]


def staging_plan(nbytes: list[int], staging_bytes: int) -> list[list[_Segment]]:
    """Cut the tensors' bytes (laid one after another) into buffers of at most staging_bytes, whole digest
    blocks each (staging_bytes >= one block): a buffer is one contiguous range of the file."""
    buffers: list[list[_Segment]] = [[]]
    used = 0
    for index, size in enumerate(nbytes):
        blocks: list[tuple[int, int]] = []
        start = 0
        for offset in block_spans(size):
            length = min(DIGEST_BLOCK_BYTES, size - offset)
            if used + length > staging_bytes:
                if blocks:
                    buffers[-1].append(_Segment(index, start, offset - start, blocks[0][0], tuple(blocks)))
                buffers.append([])
                used, blocks, start = 0, [], offset
            blocks.append((used, length))
            used += length
        buffers[-1].append(_Segment(index, start, size - start, blocks[0][0], tuple(blocks)))
    return buffers


def _write_staged(f, tensors: list[torch.Tensor], pool: ThreadPoolExecutor, staging_bytes: int) -> list[Future]:
    """Device-to-host copies into a ring of staging buffers, in big asynchronous pieces on each tensor's
    device's current stream (so after the work that produced it): buffer i is written and hashed while the
    copies into the next ones run."""
    sources = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    plan = staging_plan([s.numel() for s in sources], staging_bytes)
    pinned = torch.cuda.is_available() and any(s.device.type == "cuda" for s in sources)
    ring = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=pinned)
            for _ in range(min(STAGING_BUFFERS, len(plan)))]
    hashed: list[list[Future]] = [[] for _ in ring]  # the digests still reading each buffer
    ready: dict[int, list] = {}  # buffer index in the plan -> the events its copies complete
    digests: list[Future] = []

    def fill(i: int) -> None:
        slot = i % len(ring)
        for pending in hashed[slot]:
            pending.result()
        events = []
        for seg in plan[i]:
            src = sources[seg.tensor]
            ring[slot][seg.position:seg.position + seg.length].copy_(src[seg.offset:seg.offset + seg.length],
                                                                     non_blocking=True)
            if src.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(src.device))
                events.append(event)
        ready[i] = events

    for i in range(min(len(ring) - 1, len(plan))):
        fill(i)
    for i in range(len(plan)):
        if i + len(ring) - 1 < len(plan):
            fill(i + len(ring) - 1)
        for event in ready.pop(i):
            event.synchronize()
        slot = i % len(ring)
        buffer = memoryview(ring[slot].numpy())
        blocks = [buffer[p:p + n] for seg in plan[i] for p, n in seg.blocks]
        hashed[slot] = [pool.submit(block_sha256, b) for b in blocks]
        digests.extend(hashed[slot])
        end = max((seg.position + seg.length for seg in plan[i]), default=0)
        _write_fully(f, buffer[:end])
    for pending in digests:  # every buffer is read before the ring is freed
        pending.result()
    return digests


def _write_fully(f, data: memoryview) -> None:
    while len(data):
        written = f.write(data)
        data = data[written:]


# ------------------------------------------------------------------ reader --


def read_weight_dir(directory: str | Path, *, policy_version: int, expected_sha256: str,
                    threads: int | None = None, allocate: Callable[[int], torch.Tensor] | None = None
                    ) -> tuple[dict[str, torch.Tensor], WeightFiles]:
    """The directory's tensors, after its layout, its version and its digest (recomputed here over the bytes
    returned) are checked; a FiniteTensors when every floating value was found finite, else a plain dict.

    `allocate(nbytes)` gives the memory each tensor is read into (flat uint8, 64-byte aligned; e.g. a
    services.rollout.weights.staging_arena lease, whose memory is already faulted in): new memory by default."""
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise WeightFilesError(f"directory: no {WEIGHTS_FILE} in {str(directory)!r}")
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        try:
            first = _read_prefix(f, HEADER_LENGTH_BYTES)
            header = parse_header(first + _read_prefix(f, header_length(first, size)), size)
        except SafetensorsLayoutError as exc:
            raise WeightFilesError(f"directory: {WEIGHTS_FILE} in {str(directory)!r}: {exc}") from None
        order = _checked_order(header.metadata, header.tensors, directory, policy_version)
        tensors = FiniteTensors((name, _tensor_for(header.tensors[name], allocate)) for name in order)
        with ThreadPoolExecutor(threads or block_pool_threads(), thread_name_prefix="weights-read") as pool:
            work: list[tuple[str, Future]] = []
            for name in order:
                span, view = header.tensors[name], tensor_byte_view(tensors[name])
                for offset in block_spans(span.nbytes):
                    work.append((name, pool.submit(_read_block, f.fileno(), view[offset:offset + DIGEST_BLOCK_BYTES],
                                                   header.data_start + span.start + offset, span.dtype)))
            results = [(name, future.result()) for name, future in work]
    digest = digest_of_blocks(block for _, (block, _) in results)
    if digest != expected_sha256:
        raise WeightFilesError(f"expected_sha256: the directory's tensors hash to {digest}, "
                               f"not {expected_sha256}")
    # Refusing non-finite values is the engine's (the same refusal whichever source moved them): the type
    # tells it whether every value was found finite here.
    if not all(finite for _, (_, finite) in results):
        tensors = dict(tensors)
    nbytes = sum(header.tensors[n].nbytes for n in order)
    return tensors, WeightFiles(Path(directory), policy_version, len(order), nbytes, digest)


def _checked_order(metadata: dict[str, str], spans: dict[str, TensorSpan], directory: str | Path,
                   policy_version: int) -> list[str]:
    try:
        version = int(metadata[VERSION_KEY])
        order = json.loads(metadata[ORDER_KEY])
    except (KeyError, ValueError) as exc:
        raise WeightFilesError(f"directory: {str(directory)!r} is not a WriteWeights directory "
                               f"(metadata {exc})") from None
    if version != policy_version:
        raise WeightFilesError(f"policy_version: the directory holds version {version}, not {policy_version}")
    if (not isinstance(order, list) or not all(isinstance(n, str) for n in order)
            or len(set(order)) != len(order) or set(order) != set(spans)):
        raise WeightFilesError("directory: the recorded tensor order does not name the file's tensors")
    return order


def _read_prefix(f, nbytes: int) -> bytes:
    data = f.read(nbytes)
    if len(data) != nbytes:
        raise SafetensorsLayoutError(f"header: the file ended after {len(data)} of {nbytes} bytes")
    return data


def _tensor_for(span: TensorSpan, allocate: Callable[[int], torch.Tensor] | None) -> torch.Tensor:
    if allocate is None:
        return torch.empty(span.shape, dtype=span.dtype)
    return allocate(span.nbytes).view(span.dtype).reshape(span.shape)


def _read_block(fd: int, view: memoryview, offset: int, dtype: torch.dtype) -> tuple[bytes, bool]:
    """Read `view` from the file at `offset`, then its digest and whether its values were found finite
    (False also for a floating dtype the byte check does not know: the engine checks those)."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise WeightFilesError(f"data: the file ends at byte {offset + got}, inside a tensor its header "
                                   "places there (it changed while read)")
        got += n
    if not dtype.is_floating_point:
        finite = True
    else:
        finite = checks_bytes(dtype) and bytes_all_finite(np.frombuffer(view, dtype=np.uint8), dtype)
    return block_sha256(view), finite

