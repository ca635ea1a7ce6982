"""The control collectives of a multi-rank trainer: commands, statuses, results in order.

The model itself is sharded by FSDP (services/trainer/distributed/sharding.py), which
reduce-scatters the gradients; this is what travels beside it. A step's
microbatches are built identically on every rank (canonical sample order);
rank r trains on microbatches r, r + N, r + 2N, ...

Determinism: the per-microbatch results the metrics are made from (log-probs,
losses, masks) are gathered back into global microbatch order. Each
microbatch's forward runs on the same compute-dtype weights whatever N is, so
a step's metrics other than grad_norm are bitwise those of one rank for the
same weights. Gradients are summed in another order than one rank
accumulates them, so the updated weights (and grad_norm) are reproducible run
to run at a fixed N, equal across N only to float rounding — and so are the
metrics of the steps after the first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


@dataclass
class DataParallel:
    rank: int
    world_size: int
    control: object  # a gloo process group: Python objects (commands, gathered results) travel here

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share: items rank, rank + world_size, ..."""
        return list(items[self.rank::self.world_size])

    def gather_in_order(self, local: Sequence[T], total: int) -> list[T]:
        """Every rank's shard() results, back in global order, on every rank."""
        per_rank: list[list[T] | None] = [None] * self.world_size
        dist.all_gather_object(per_rank, list(local), group=self.control)
        out = []
        for i in range(total):
            out.append(per_rank[i % self.world_size][i // self.world_size])
        return out

    def broadcast_command(self, command: object | None) -> object:
        """Rank 0 sends `command`; every rank returns it."""
        box = [command]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_status(self, status: tuple[bool, str]) -> list[tuple[bool, str]]:
        """(ok, error) of every rank, in rank order, on every rank."""
        out: list[tuple[bool, str] | None] = [None] * self.world_size
        dist.all_gather_object(out, status, group=self.control)
        return out  # type: ignore[return-value]
