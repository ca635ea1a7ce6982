"""Host staging of a decode step's inputs, rebuilt incrementally and uploaded without a host stall.

Per decode step the decoder hands the model four inputs per row: the token fed, its position, the context
length (position + 1) and the row's block table. Rebuilding the block tables from each sequence's page
list every step costs host time that grows with rows x pages, while between two consecutive steps a row's
table changes in at most its last entry: the scheduler either appends a page (the row entered a new one)
or replaces the last page (copy on write of a shared prompt page). So a row of the staged table is
rewritten in full only when another sequence takes that row, and otherwise only from its last entry on.

The staged buffers are pinned on CUDA, so their copies into the captured graph's input buffers are
asynchronous (stream-ordered before the replay). A buffer is rewritten only after the previous step's
tokens were read on the host, which waits for the stream past that step's copies, so no copy can read a
buffer the host is changing.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.rollout.embedded.kv_cache import SCRATCH_PAGE
from services.rollout.embedded.scheduler import DecodeSequence


class StepInputs:
    """Pinned host copies of ids, positions, lengths and block tables for up to `rows` decode rows."""

    def __init__(self, rows: int, table_width: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.ids = torch.zeros((rows, 1), dtype=torch.int64, pin_memory=pin)
        self.positions = torch.zeros((rows, 1), dtype=torch.int64, pin_memory=pin)
        self.lengths = torch.ones(rows, dtype=torch.int32, pin_memory=pin)
        self.tables = torch.zeros((rows, table_width), dtype=torch.int32, pin_memory=pin)
        self.sample_keys = torch.zeros(2 * rows, dtype=torch.int64, pin_memory=pin)
        """Viewed as [2, n]: [0] each row's request index, [1] its step in its sampling stream."""
        self._tables = self.tables.numpy()
        # What row b of the staged table holds: the sequence of the previous step's row b and how many of
        # its pages were written (0: nothing valid). Only rows of the previous step keep an entry.
        self._holder: list[DecodeSequence | None] = [None] * rows
        self._written = [0] * rows
        self._last = [SCRATCH_PAGE] * rows
        """The last page written into each row (a copy on write replaces it without changing the count)."""
        self._rows = 0

    def reset(self) -> None:
        """Forget the previous decode's rows (a new decode starts; nothing staged is reused)."""
        self._holder = [None] * len(self._holder)
        self._written = [0] * len(self._written)
        self._rows = 0

    def stage(self, rows: Sequence[DecodeSequence], bucket: int, pad_token_id: int) -> int:
        """Write the inputs of `rows` (padded to `bucket` rows); the sum of their context lengths."""
        n = len(rows)
        tables, holder, written = self._tables, self._holder, self._written
        for b in range(n, max(self._rows, bucket)):
            holder[b], written[b] = None, 0
        # Padded rows decode the pad token at position 0 of the scratch page, which nothing reads.
        tables[n:bucket, 0] = SCRATCH_PAGE
        last = self._last
        for b, s in enumerate(rows):
            pages = s.pages
            if holder[b] is s:
                # The same sequence as last step: entries before its last written page are unchanged, and
                # most steps change none (the row stays in its page, which was not replaced).
                if written[b] == len(pages) and last[b] == pages[-1]:
                    continue
                first = written[b] - 1
            else:
                holder[b], first = s, 0
            tables[b, first:len(pages)] = pages[first:]
            written[b], last[b] = len(pages), pages[-1]
        self._rows = n
        pos = np.fromiter((s.computed for s in rows), dtype=np.int64, count=n)
        ids = np.fromiter((s.tokens[s.computed] if s.finish_reason is None else pad_token_id for s in rows),
                          dtype=np.int64, count=n)
        self.positions.numpy()[:bucket, 0] = 0
        self.positions.numpy()[:n, 0] = pos
        self.ids.numpy()[:bucket, 0] = pad_token_id
        self.ids.numpy()[:n, 0] = ids
        self.lengths.numpy()[:bucket] = self.positions.numpy()[:bucket, 0] + 1
        return int(pos.sum()) + n

    def upload(self, bufs: tuple[torch.Tensor, ...], bucket: int) -> None:
        """Copy the staged rows [0, bucket) into device buffers (ids, positions, lengths, tables)."""
        for buf, host in zip(bufs, (self.ids, self.positions, self.lengths, self.tables)):
            buf[:bucket].copy_(host[:bucket], non_blocking=True)

    def on_device(self, bucket: int) -> tuple[torch.Tensor, ...]:
        """Fresh device tensors of the staged rows [0, bucket) (the uncaptured step)."""
        return tuple(h[:bucket].to(self.device, copy=True)
                     for h in (self.ids, self.positions, self.lengths, self.tables))

    def keys(self, members: Sequence[DecodeSequence]) -> torch.Tensor:
        """int64 [2, len(members)] on the device: each member's request index and its step in its stream."""
        n = len(members)
        staged = self.sample_keys[:2 * n].view(2, n)
        host = staged.numpy()
        host[0] = np.fromiter((s.index for s in members), dtype=np.int64, count=n)
        host[1] = np.fromiter((s.generated for s in members), dtype=np.int64, count=n)
        return staged.to(self.device, non_blocking=True, copy=True)
