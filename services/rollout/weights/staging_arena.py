"""Host memory a replica receives weights into, kept from one sync to the next.

Memory the process has not touched yet costs a page fault per 4 KiB page on its first write: on a
2-core host a copy into new memory ran at a third of the rate of a copy into memory already written.
A replica syncs the same tensors every step, so it keeps one buffer of the size the last sync needed,
and, for an engine on a GPU, pins it once so that the copies to the device run at the link's rate.
The price is one host copy of the weights held between syncs.

One sync at a time leases the arena; a sync that finds it leased gets fresh memory instead of waiting.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_ALIGN = 64  # each tensor's bytes start at a multiple of this, so they view as any dtype


class StagingArena:
    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._wanted = 0       # bytes the last lease needed: the next lease starts with that much
        self._lock = threading.Lock()
        self._leased = False

    @property
    def capacity(self) -> int:
        return self._buffer.numel()

    def _fresh(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)

    @contextlib.contextmanager
    def lease(self) -> Iterator["ArenaLease"]:
        """Exclusive use of the arena for one sync (the tensors it hands out are valid until the block
        ends: the engine must have copied them in by then)."""
        with self._lock:
            mine, self._leased = not self._leased, True
        if not mine:
            yield ArenaLease(torch.empty(0, dtype=torch.uint8), self._fresh)
            return
        try:
            if self._buffer.numel() < self._wanted:
                self._buffer = torch.empty(0, dtype=torch.uint8)  # let go before allocating the larger one
                self._buffer = self._fresh(self._wanted)
            lease = ArenaLease(self._buffer, self._fresh)
            yield lease
            self._wanted = max(self._wanted, lease.needed)
        finally:
            with self._lock:
                self._leased = False


class ArenaLease:
    """Hands out consecutive pieces of the buffer; past its end, fresh memory (and the arena grows to
    what this lease needed for the next one)."""

    def __init__(self, buffer: torch.Tensor, fresh) -> None:
        self._buffer, self._fresh = buffer, fresh
        self._cursor = 0
        self.needed = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        start = self._cursor
        self._cursor = self.needed = start + -(-nbytes // _ALIGN) * _ALIGN
        if self._cursor <= self._buffer.numel():
            return self._buffer[start:start + nbytes]
        return self._fresh(nbytes)
