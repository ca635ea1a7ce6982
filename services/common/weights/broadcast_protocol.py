"""Weights by collective broadcast: the bucket plan, bucket packing and the weight-update group.

The trainer (rank 0) and the replicas being synced (ranks 1..N) join one torch.distributed process group
for one sync. Tensors go in the order the trainer holds them (GetWeights' order), cut into buckets: a run
of consecutive tensors of one dtype, at most `bucket_bytes` together (a larger tensor is a bucket of its
own). A bucket travels as one flat uint8 buffer, its tensors' bytes back to back -- SGLang's
"flattened_bucket" layout (sglang/srt/weight_sync/tensor_bucket.py), so an SGLang server can be a rank.
Names, dtypes and shapes travel beside it (pb.BroadcastPlan). hash_buffer adds each packed tensor to the
weights digest (services.common.weights.digest), so a broadcast's digest is the GetWeights stream's total_sha256.

The group is built the way SGLang builds its weight-update group (sglang/srt/utils/common.py
init_custom_process_group, over torch's _new_process_group_helper): a store at the rendezvous, its
keys under `<group_name>`, then `<group_name>/`, then `<device>/`, and a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (CUDA; RCCL on ROCm) on it. Built from those public classes rather than through
torch.distributed's group registry, so it needs no default process group and leaves any other group of
the process (the trainer's data-parallel one) alone. The store is the trainer's authenticated
rendezvous (services/common/rendezvous/key_table.py): the trainer's rank reads it in process, a replica's rank
through a RendezvousClient, an SGLang server's ranks through the rollout service's TcpStoreBridge.

The group's constructor blocks until every rank joins or the timeout passes, and nothing can stop it
meanwhile. So no rank enters it while another may never come: each rank > 0 first sets
`<group_name>/joined/<rank>` in the store and waits for rank 0 to set `<group_name>/formed` (every rank
announced) or `<group_name>/abandoned` (its reason: rank 0 was told to give up, or timed out), or for the
trainer to close the group (GroupClosed, with the same reason). Those keys lie outside the
`<group_name>/<group_name>/` prefix the process group's own keys get here and in SGLang.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from proto import lockstep_pb2 as pb
from services.common.rendezvous.key_table import GroupClosed
from services.common.tensors import dtype_from_name, dtype_name
from services.common.weights.digest import BlockDigests

BACKENDS = ("gloo", "nccl")
DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
# How often a rank waiting at the join barrier looks at the store (a check is one round trip on loopback).
JOIN_POLL_S = 0.05


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # wire dtype name (services.common.tensors)
    shape: tuple[int, ...]
    nbytes: int


def tensor_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(tensor.dtype), tuple(tensor.shape), tensor.numel() * tensor.element_size())


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive runs of one dtype, each at most `bucket_bytes` unless one tensor alone is larger. Pure."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        current = buckets[-1] if buckets else None
        if current is None or current[0].dtype != spec.dtype or size + spec.nbytes > bucket_bytes:
            buckets.append([spec])
            size = spec.nbytes
        else:
            current.append(spec)
            size += spec.nbytes
    return buckets


def plan_proto(buckets: Sequence[Sequence[TensorSpec]], **fields: object) -> pb.BroadcastPlan:
    return pb.BroadcastPlan(
        buckets=[pb.BroadcastBucket(tensors=[pb.BroadcastTensor(name=s.name, dtype=s.dtype, shape=list(s.shape))
                                             for s in bucket], nbytes=sum(s.nbytes for s in bucket))
                 for bucket in buckets],
        tensors=sum(len(b) for b in buckets), bytes=sum(s.nbytes for b in buckets for s in b), **fields)


def bucket_specs(plan: pb.BroadcastPlan) -> list[list[TensorSpec]]:
    """The plan's buckets, checked (ValueError naming the field): known dtypes, non-negative shapes, one
    dtype and a byte count that adds up per bucket, unique names, totals that match."""
    out: list[list[TensorSpec]] = []
    names: set[str] = set()
    for b, bucket in enumerate(plan.buckets):
        where = f"plan.buckets[{b}]"
        if not bucket.tensors:
            raise ValueError(f"{where}.tensors: empty")
        specs = []
        for t, tensor in enumerate(bucket.tensors):
            dtype = dtype_from_name(tensor.dtype, field=f"{where}.tensors[{t}].dtype")
            shape = tuple(int(d) for d in tensor.shape)
            if not tensor.name or tensor.name in names:
                raise ValueError(f"{where}.tensors[{t}].name: empty or repeated ({tensor.name!r})")
            if any(d < 0 for d in shape):
                raise ValueError(f"{where}.tensors[{t}].shape: negative dimension in {list(shape)}")
            names.add(tensor.name)
            specs.append(TensorSpec(tensor.name, tensor.dtype, shape,
                                    math.prod(shape) * torch.empty(0, dtype=dtype).element_size()))
        if len({s.dtype for s in specs}) != 1:
            raise ValueError(f"{where}: tensors of more than one dtype")
        if sum(s.nbytes for s in specs) != bucket.nbytes:
            raise ValueError(f"{where}.nbytes: {bucket.nbytes}, but its tensors hold {sum(s.nbytes for s in specs)}")
        out.append(specs)
    if not out:
        raise ValueError("plan.buckets: empty")
    if plan.tensors != len(names) or plan.bytes != sum(b.nbytes for b in plan.buckets):
        raise ValueError(f"plan.tensors/bytes: {plan.tensors}/{plan.bytes} do not match the buckets")
    return out


def pack_bucket(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One flat uint8 buffer on `device` holding the tensors' bytes back to back."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors])


def unpack_bucket(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` as the bucket's tensors (no copy)."""
    out, offset = [], 0
    for spec in specs:
        piece = buffer[offset:offset + spec.nbytes]
        out.append((spec.name, piece.view(dtype_from_name(spec.dtype)).reshape(spec.shape)))
        offset += spec.nbytes
    return out


def hash_buffer(digests: BlockDigests, buffer: torch.Tensor, tensors: Sequence[tuple[str, int]]) -> None:
    """Add a bucket's tensors ((name, nbytes), packed in order) to the weights digest, so that it is the
    GetWeights stream's digest of the same weights (copied to host first when the buffer lives on a device)."""
    host, offset = memoryview(buffer.detach().cpu().numpy()), 0
    for name, nbytes in tensors:
        digests.add(name, 0, host[offset:offset + nbytes], nbytes)
        offset += nbytes


class GroupNotFormed(RuntimeError):
    """The join barrier ended without every rank: nobody entered the process group's constructor."""


def joined_key(group_name: str, rank: int) -> str:
    return f"{group_name}/joined/{rank}"


def formed_key(group_name: str) -> str:
    return f"{group_name}/formed"


def abandoned_key(group_name: str) -> str:
    return f"{group_name}/abandoned"


def abandon_group(store: dist.Store, group_name: str, reason: str) -> None:
    """Rank 0 gives up on the group: every rank waiting at the barrier fails with `reason`."""
    store.set(abandoned_key(group_name), reason)


def await_ranks(store: dist.Store, group_name: str, world_size: int, *, timeout_s: float,
                abort_reason: Callable[[], str | None], poll_s: float = JOIN_POLL_S) -> None:
    """Rank 0's barrier: returns once ranks 1..world_size-1 announced themselves (and marks the group
    formed). When `abort_reason()` returns a reason, or `timeout_s` passes first, the group is marked
    abandoned and GroupNotFormed names the ranks that never joined and why."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(1, world_size) if not store.check([joined_key(group_name, r)])]
        if not missing:
            store.set(formed_key(group_name), "1")
            return
        reason = abort_reason()
        if reason is None and time.monotonic() >= deadline:
            reason = f"not within {timeout_s:g} s"
        if reason is not None:
            abandon_group(store, group_name, reason)
            raise GroupNotFormed(f"group {group_name}: rank{'s' if len(missing) > 1 else ''} "
                                 f"{', '.join(map(str, missing))} of {world_size} never joined: {reason}")
        time.sleep(poll_s)


def join_when_formed(store: dist.Store, group_name: str, rank: int, *, timeout_s: float,
                     poll_s: float = JOIN_POLL_S) -> None:
    """A rank > 0 announces itself and returns once rank 0 saw every rank; GroupNotFormed when rank 0
    abandoned the group (its reason) or did not form it within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    try:
        store.set(joined_key(group_name, rank), "1")
        while not store.check([formed_key(group_name)]):
            if store.check([abandoned_key(group_name)]):
                reason = store.get(abandoned_key(group_name)).decode(errors="replace")
                raise GroupNotFormed(f"group {group_name}: rank 0 abandoned it: {reason}")
            if time.monotonic() >= deadline:
                raise GroupNotFormed(f"group {group_name}: rank 0 did not form it within {timeout_s:g} s")
            time.sleep(poll_s)
    except GroupClosed as exc:  # the trainer gave up and dropped the group's keys before this rank looked
        raise GroupNotFormed(f"group {group_name}: rank 0 abandoned it: {exc.reason}") from None


def never_aborted() -> str | None:
    return None


class WeightUpdateGroup:
    """One sync's process group: rank 0 broadcasts, every other rank receives. Every rank passes the join
    barrier first (rank 0: `abort_reason` may end its wait early)."""

    def __init__(self, store: dist.Store, *, group_name: str, rank: int, world_size: int, backend: str,
                 timeout_s: float, abort_reason: Callable[[], str | None] = never_aborted) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {list(BACKENDS)}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank/world_size: need 0 <= rank < world_size >= 2, got {rank}/{world_size}")
        if rank == 0:
            await_ranks(store, group_name, world_size, timeout_s=timeout_s, abort_reason=abort_reason)
        else:
            join_when_formed(store, group_name, rank, timeout_s=timeout_s)
        device = "cuda" if backend == "nccl" else "cpu"
        keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))
        timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            self._pg = dist.ProcessGroupGloo(keys, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            options.group_name = group_name
            self._pg = dist.ProcessGroupNCCL(keys, rank, world_size, options)
        # A store written in Python lives only while Python holds it: the process group's own reference
        # does not keep it, and NCCL reads it again after this constructor (its unique id, its monitor).
        self._store = store
        self.backend, self.rank, self.world_size = backend, rank, world_size

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0's `buffer` into every rank's (same size), complete on return."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._pg.broadcast([buffer], options).wait()
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()

    def close(self) -> None:
        shutdown = getattr(self._pg, "shutdown", None)
        if self.backend == "nccl" and shutdown is not None:
            shutdown()
        self._pg = None
        self._store = None
