"""The weights digest recomputed from its definition, and a count of what is fed to sha256: what the
tests of every digest computer (stream sender and receiver, shared-path writer and reader) check against."""
from __future__ import annotations

import hashlib
import threading

import torch

BLOCK = 4 * 1024 * 1024  # the definition's block and leaf sizes, written out rather than imported
LEAF = 256 * 1024


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def block_by_definition(block: bytes) -> bytes:
    """A block's digest: sha256 over the sha256 of its 256 KiB leaves (an empty block is one empty leaf)."""
    return hashlib.sha256(b"".join(hashlib.sha256(block[o:o + LEAF]).digest()
                                   for o in range(0, max(len(block), 1), LEAF))).digest()


def digest_by_definition(weights: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the digests of every tensor's 4 MiB blocks (an empty tensor is one empty block), in order."""
    return digest_of_byte_strings([raw_bytes(t) for _, t in weights])


def digest_of_byte_strings(tensors: list[bytes]) -> str:
    """The definition over tensors given as their raw bytes."""
    return hashlib.sha256(b"".join(block_by_definition(data[o:o + BLOCK]) for data in tensors
                                   for o in range(0, max(len(data), 1), BLOCK))).hexdigest()


def bytes_fed_once(sizes: list[int]) -> int:
    """What sha256 is fed when every byte of tensors of these sizes is hashed once: each byte in its leaf,
    each leaf digest in its block's digest, each block digest in the total."""
    fed = 0
    for nbytes in sizes:
        for start in range(0, max(nbytes, 1), BLOCK):
            length = min(BLOCK, nbytes - start)
            fed += length + 32 * len(range(0, max(length, 1), LEAF)) + 32
    return fed


class Sha256Counter:
    """Replaces hashlib.sha256 (through `monkeypatch`, undone after the test) by one that adds every byte
    it is fed, at construction or by update(), to `fed`. Thread-safe: the hash pools feed it from many
    threads at once."""

    def __init__(self, monkeypatch) -> None:
        self.fed = 0
        lock, real, counter = threading.Lock(), hashlib.sha256, self

        class Counting:
            def __init__(self, data=b"") -> None:
                self._h = real()
                self.update(data)

            def update(self, data) -> None:
                with lock:
                    counter.fed += memoryview(data).nbytes
                self._h.update(data)

            def digest(self) -> bytes:
                return self._h.digest()

            def hexdigest(self) -> str:
                return self._h.hexdigest()

        monkeypatch.setattr(hashlib, "sha256", Counting)
