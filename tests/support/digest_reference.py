"""The weights digest recomputed from its definition, and a count of what is fed to sha256: what the
tests of every digest computer (stream sender and receiver, shared-path writer and reader) check against."""
from __future__ import annotations

import hashlib
import threading

import torch

BLOCK = 4 * 1024 * 1024  # the definition's block size, written out rather than imported


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest_by_definition(weights: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over the sha256 of every tensor's 4 MiB blocks (an empty tensor is one empty block), in order."""
    digests = b""
    for _, t in weights:
        data = raw_bytes(t)
        digests += b"".join(hashlib.sha256(data[o:o + BLOCK]).digest() for o in range(0, max(len(data), 1), BLOCK))
    return hashlib.sha256(digests).hexdigest()


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
