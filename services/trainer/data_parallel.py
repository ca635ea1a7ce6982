"""Data parallelism inside one trainer service: the collectives a step needs, and nothing else.

Every rank holds a full replica of the model and optimizer. A step's
microbatches are built identically on every rank (canonical sample order);
rank r trains on microbatches r, r + N, r + 2N, ... The gradients are summed
over ranks with one all-reduce per dtype bucket, so every rank applies the
same update and the replicas stay bitwise equal.

Determinism: the per-microbatch results the metrics are made from (log-probs,
losses, masks) are gathered back into global microbatch order, so the step's
metrics other than grad_norm are bitwise those of one rank. Gradients are
summed in a different order than one process accumulates them, so weights and
grad_norm are reproducible run to run at a fixed world size, but not bitwise
equal to world size 1.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
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

    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum .grad over ranks. A parameter no rank produced a gradient for keeps grad None (as one process
        would: the optimizer skips it); one that only some ranks touched counts zero on the others."""
        flags = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.control)
        used = [p for p, f in zip(params, flags.tolist()) if f]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in used:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for bucket in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

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
