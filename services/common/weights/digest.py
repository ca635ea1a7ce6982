"""The digest of one set of weights, the same whichever source moved them (gRPC stream, shared path).

Definition: every tensor's raw bytes are cut into blocks of DIGEST_BLOCK_BYTES from its start (the last
block of a tensor may be shorter; a tensor of no bytes is one empty block); the digest is the sha256 of
the concatenated 32-byte sha256 digests of all blocks, tensors in stream order. It covers every byte
once, and a stream whose chunks are exactly these blocks (the default chunk size) hashes each byte once
per side: a chunk's verified digest is its block's digest.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

DIGEST_BLOCK_BYTES = 4 * 1024 * 1024
# Threads hashing blocks when a whole set of tensors is at hand (hashlib releases the GIL on large buffers).
DEFAULT_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def block_pool_threads() -> int:
    """Threads for per-block work (read, hash, check) over a whole set of tensors: one per CPU. Each block's
    work runs outside the GIL (file reads, hashlib on large buffers, numpy reductions)."""
    return max(1, os.cpu_count() or 1)


def block_sha256(data: bytes | memoryview) -> bytes:
    """One digest block's 32-byte sha256."""
    return hashlib.sha256(data).digest()


def tensor_byte_view(tensor: torch.Tensor) -> memoryview:
    """The tensor's raw little-endian bytes as a flat view (one copy only if it is not contiguous on CPU)."""
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def block_spans(nbytes: int) -> range:
    """Start offsets of a tensor's digest blocks (one block at 0 for an empty tensor)."""
    return range(0, max(nbytes, 1), DIGEST_BLOCK_BYTES)


def digest_of_blocks(block_digests: Iterable[bytes]) -> str:
    return hashlib.sha256(b"".join(block_digests)).hexdigest()


class BlockDigests:
    """Collects the block digests of tensors fed as (offset, bytes) pieces in order, cut anyhow.

    A piece that is exactly one block brings its own (already computed, verified) digest and costs
    nothing; any other piece is hashed here into the blocks it overlaps."""

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self._partial: dict[str, object] = {}  # tensor name -> sha256 state of its unfinished block

    @staticmethod
    def is_block(offset: int, length: int, tensor_nbytes: int) -> bool:
        return offset % DIGEST_BLOCK_BYTES == 0 and length == min(DIGEST_BLOCK_BYTES, tensor_nbytes - offset)

    def add(self, name: str, offset: int, data: bytes | memoryview, tensor_nbytes: int,
            data_sha256: bytes | None = None) -> None:
        """`data` is bytes [offset, offset + len) of tensor `name`; `data_sha256` its digest if known."""
        if name not in self._partial and self.is_block(offset, len(data), tensor_nbytes):
            self.digests.append(data_sha256 if data_sha256 is not None else hashlib.sha256(data).digest())
            return
        view, position = memoryview(data), offset
        while True:
            block_end = min((position // DIGEST_BLOCK_BYTES + 1) * DIGEST_BLOCK_BYTES, tensor_nbytes)
            take = min(len(view), block_end - position)
            state = self._partial.setdefault(name, hashlib.sha256())
            state.update(view[:take])
            view, position = view[take:], position + take
            if position == block_end:
                self.digests.append(self._partial.pop(name).digest())
            if not len(view):
                return

    def hexdigest(self) -> str:
        if self._partial:
            raise ValueError(f"tensors {sorted(self._partial)} ended inside a digest block")
        return digest_of_blocks(self.digests)


def _blocks(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[memoryview]:
    for _, tensor in named_tensors:
        view = tensor_byte_view(tensor)
        for offset in block_spans(len(view)):
            yield view[offset : offset + DIGEST_BLOCK_BYTES]


def tensors_digest(named_tensors: Sequence[tuple[str, torch.Tensor]],
                   threads: int = DEFAULT_HASH_THREADS) -> tuple[str, int]:
    """(digest, bytes) of the tensors in order, their blocks hashed on `threads` threads."""
    blocks = list(_blocks(named_tensors))
    nbytes = sum(len(b) for b in blocks)
    if threads <= 1 or len(blocks) == 1:
        return digest_of_blocks(hashlib.sha256(b).digest() for b in blocks), nbytes
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sha256-block") as pool:
        return digest_of_blocks(pool.map(lambda b: hashlib.sha256(b).digest(), blocks)), nbytes
