"""The digest of one set of weights, the same whichever source moved them (gRPC stream, shared path, IPC).

Definition: every tensor's raw bytes are cut into blocks of DIGEST_BLOCK_BYTES from its start (the last
block of a tensor may be shorter; a tensor of no bytes is one empty block); each block is cut the same way
into leaves of DIGEST_LEAF_BYTES, and a block's digest is the sha256 of its leaves' concatenated 32-byte
sha256 digests (`block_sha256`); the weights digest is the sha256 of the concatenated block digests, tensors
in stream order. It covers every byte once, and a stream whose chunks are exactly these blocks (the default
chunk size) hashes each byte once per side: a chunk's verified digest (`block_sha256` of its bytes) is its
block's digest.

Why leaves: a sha256 is one chain of compressions that cannot be split. On a host that costs nothing (one
core hashes a block as fast as its leaves), but a GPU hashes a leaf per lane, and with 4 MiB chains it had
one lane per block: a few hundred lanes, each 65,536 compressions long, tens of milliseconds whatever the
policy's size (kernels/digest/sha256_blocks.py). 256 KiB leaves give 16 times the lanes and a 16 times
shorter chain, while a block stays the unit of streaming, reading and checking.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

DIGEST_BLOCK_BYTES = 4 * 1024 * 1024
DIGEST_LEAF_BYTES = 256 * 1024  # a divisor of DIGEST_BLOCK_BYTES: every block but a tensor's last has 16 leaves
# Threads hashing blocks when a whole set of tensors is at hand (hashlib releases the GIL on large buffers).
DEFAULT_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


def block_pool_threads() -> int:
    """Threads for per-block work (read, hash, check) over a whole set of tensors: one per CPU. Each block's
    work runs outside the GIL (file reads, hashlib on large buffers, numpy reductions)."""
    return max(1, os.cpu_count() or 1)


def leaf_spans(nbytes: int) -> range:
    """Start offsets of a block's leaves (one empty leaf at 0 for an empty block)."""
    return range(0, max(nbytes, 1), DIGEST_LEAF_BYTES)


def block_sha256(data: bytes | memoryview) -> bytes:
    """One digest block's 32-byte digest: the sha256 of its leaves' sha256 digests (also a chunk's, whatever
    its size). hashlib releases the GIL on each leaf, so blocks hash in parallel on threads."""
    view = memoryview(data)
    return hashlib.sha256(b"".join(hashlib.sha256(view[o:o + DIGEST_LEAF_BYTES]).digest()
                                   for o in leaf_spans(len(view)))).digest()


class BlockHasher:
    """`block_sha256` of bytes fed in pieces cut anyhow: update() as hashlib's, digest() once at the end."""

    def __init__(self) -> None:
        self._leaves: list[bytes] = []
        self._leaf = hashlib.sha256()
        self._in_leaf = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), DIGEST_LEAF_BYTES - self._in_leaf)
            self._leaf.update(view[:take])
            self._in_leaf += take
            view = view[take:]
            if self._in_leaf == DIGEST_LEAF_BYTES:
                self._leaves.append(self._leaf.digest())
                self._leaf, self._in_leaf = hashlib.sha256(), 0

    def digest(self) -> bytes:
        leaves = self._leaves + [self._leaf.digest()] if self._in_leaf or not self._leaves else self._leaves
        return hashlib.sha256(b"".join(leaves)).digest()


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
        self._partial: dict[str, BlockHasher] = {}  # tensor name -> the state of its unfinished block

    @staticmethod
    def is_block(offset: int, length: int, tensor_nbytes: int) -> bool:
        return offset % DIGEST_BLOCK_BYTES == 0 and length == min(DIGEST_BLOCK_BYTES, tensor_nbytes - offset)

    def add(self, name: str, offset: int, data: bytes | memoryview, tensor_nbytes: int,
            data_sha256: bytes | None = None) -> None:
        """`data` is bytes [offset, offset + len) of tensor `name`; `data_sha256` its digest if known."""
        if name not in self._partial and self.is_block(offset, len(data), tensor_nbytes):
            self.digests.append(data_sha256 if data_sha256 is not None else block_sha256(data))
            return
        view, position = memoryview(data), offset
        while True:
            block_end = min((position // DIGEST_BLOCK_BYTES + 1) * DIGEST_BLOCK_BYTES, tensor_nbytes)
            take = min(len(view), block_end - position)
            state = self._partial.setdefault(name, BlockHasher())
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
        return digest_of_blocks(block_sha256(b) for b in blocks), nbytes
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sha256-block") as pool:
        return digest_of_blocks(pool.map(block_sha256, blocks)), nbytes
