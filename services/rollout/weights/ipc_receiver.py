"""A replica's side of the IPC weight source (MapWeights), for engines that hold their model in this process.

The replica asks the trainer itself for the handles (GetWeightHandles, with the deployment's token, at an
address of its weight_sources: a caller of MapWeights names only a handover id, never a handle) and checks
what came back before anything is mapped (ipc_transport.check_handles): the run, version and handover id it
asked for, a version newer than the one it serves, this node, and for CUDA a device it sees -- mapped on its
own index of that device, whatever index the trainer has. It maps each bucket, hashes what it mapped, has
the trainer compare that with its own digest of the buckets (VerifyWeightHandover answers the trainer's), and
only when they are equal checks their values finite, bucket by bucket, and hands views of the buckets to the
engine's ordinary update path, which checks them against the model and copies them in, all or nothing,
between batches. Then it drops every mapping and tells
the trainer (ReleaseWeightHandles), which frees the buckets once every replica did: on every path, refusal
and failure included (naming how many buckets it had mapped, so the trainer drops the counters of the rest).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import torch

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.process.structured_logging import log_event
from services.common.tensors import dtype_from_name
from services.common.weights import ipc_transport as ipc
from services.common.weights.bucket_digest import BucketHasher
from services.common.weights.finite_check import FiniteTensors, bucket_non_finite
from services.common.weights.stream import LoraAdapterMeta

log = logging.getLogger("lockstep.rollout.ipc")


class HandoverFailed(RuntimeError):
    """The trainer could not be reached (ABORTED: the coordinator treats it as a lost trainer); nothing was
    applied."""


class HandoverDenied(RuntimeError):
    """The trainer refused to hand the handover to this replica (FAILED_PRECONDITION, its reason); nothing was
    applied."""


WARM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the weights' dtypes a first handover may check

TRAINER_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _trainer_error(request: pb.MapWeightsRequest, method: str, exc: grpc.aio.AioRpcError) -> RuntimeError:
    kind = HandoverFailed if exc.code() in TRAINER_LOST else HandoverDenied
    return kind(f"trainer {request.trainer_address}: {method} failed with {exc.code().name}: {exc.details()}")


@dataclass
class MappedHandover:
    policy_version: int
    tensors: int
    nbytes: int
    total_sha256: str
    lora: LoraAdapterMeta | None
    phases_ms: dict[str, float]
    """Wall milliseconds of each step on this side, in order: handles (GetWeightHandles), map, digest, verify
    (VerifyWeightHandover: waits for the trainer's digest), finite, apply, unmap, release. Logged with each
    handover."""


Apply = Callable[[dict[str, torch.Tensor], int, LoraAdapterMeta | None], Awaitable[None]]


class IpcReceiver:
    """Keeps its hashing pool (and pinned ring) between handovers."""

    def __init__(self, hash_threads: int | None = None, digest_on: str = "host") -> None:
        self.node = ipc.node_id()
        self.hasher = BucketHasher(hash_threads, on=digest_on)

    def warm(self, device: torch.device) -> None:
        """A model was loaded on `device`: prepare hashing and the finite check there before the first handover
        (a first launch of each kernel loads its module: tens of milliseconds a first sync would pay)."""
        self.hasher.warm(device)
        if torch.device(device).type == "cuda":
            bucket_non_finite(torch.zeros(1024, dtype=torch.uint8, device=device),
                              [(str(d), d, i * 256, 256) for i, d in enumerate(WARM_DTYPES)])

    def close(self) -> None:
        self.hasher.close()

    async def receive(self, trainer: pb_grpc.TrainerStub, request: pb.MapWeightsRequest, *, current_version: int,
                      apply: Apply) -> MappedHandover:
        phases: dict[str, float] = {}
        clock = [time.perf_counter()]

        def lap(name: str) -> None:  # the time since the last lap, under `name`
            now = time.perf_counter()
            phases[name] = round((now - clock[0]) * 1e3, 2)
            clock[0] = now

        try:
            handles = await trainer.GetWeightHandles(pb.GetWeightHandlesRequest(
                run_id=request.run_id, policy_version=request.policy_version, handover_id=request.handover_id,
                node_id=self.node, device_uuids=ipc.visible_device_uuids()))
        except grpc.aio.AioRpcError as exc:
            raise _trainer_error(request, "GetWeightHandles", exc) from None
        lap("handles")
        mapped: list[torch.Tensor] = []
        views: dict[str, torch.Tensor] = {}  # cleared on every path: a view left alive keeps its bucket mapped
        try:
            layouts = ipc.check_handles(handles, run_id=request.run_id, policy_version=request.policy_version,
                                        handover_id=request.handover_id, current_version=current_version,
                                        node=self.node)
            index = ipc.local_index(handles.device_uuid) if handles.backend == "cuda" else -1

            def map_all() -> None:  # one by one into `mapped`: after a failure it holds those that were mapped
                for bucket in handles.buckets:
                    mapped.append(ipc.open_bucket(handles.backend, bucket, index))

            await asyncio.to_thread(map_all)
            lap("map")
            digest = await asyncio.to_thread(self.hasher.digest, mapped, layouts)
            lap("digest")
            try:
                sent = await trainer.VerifyWeightHandover(pb.VerifyWeightHandoverRequest(
                    run_id=request.run_id, handover_id=request.handover_id, share_id=handles.share_id,
                    total_sha256=digest))
            except grpc.aio.AioRpcError as exc:
                raise _trainer_error(request, "VerifyWeightHandover", exc) from None
            lap("verify")
            if sent.total_sha256 != digest:
                raise ValueError(f"weights: the mapped buckets hash to {digest}, the trainer's to "
                                 f"{sent.total_sha256}; nothing applied")
            lora = LoraAdapterMeta.from_proto(handles.lora) if handles.HasField("lora") else None
            bad = await asyncio.to_thread(_non_finite, mapped, layouts)
            if bad:
                more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
                raise ValueError("weights: " + "; ".join(f"{n}: non-finite values" for n in bad[:8]) + more)
            lap("finite")
            views.update((name, t) for buffer, layout in zip(mapped, layouts)
                         for name, t in ipc.bucket_views(buffer, layout))
            await apply(FiniteTensors(views), handles.policy_version, lora)
            lap("apply")
        finally:
            views.clear()
            was_mapped = len(mapped)
            await asyncio.to_thread(_unmap, mapped)
            lap("unmap")
            await _release(trainer, request, handles.share_id, was_mapped)
            lap("release")
        log_event(log, "weight handover mapped", run_id=request.run_id, policy_version=handles.policy_version,
                  buckets=len(handles.buckets), bytes=int(handles.bytes), phases_ms=phases)
        return MappedHandover(handles.policy_version, int(handles.tensors), int(handles.bytes), digest, lora, phases)


def _non_finite(mapped: list[torch.Tensor], layouts: list[ipc.BucketLayout]) -> list[str]:
    """The mapped buckets' tensors holding a NaN or an infinity, checked bucket by bucket (one reduction per run
    of same-dtype tensors, one read-back per bucket), so the engine need not check them tensor by tensor."""
    return [name for buffer, layout in zip(mapped, layouts) for name in bucket_non_finite(
        buffer, [(s.name, dtype_from_name(s.dtype), s.offset, s.nbytes) for s in layout.slots])]


def _unmap(mapped: list[torch.Tensor]) -> None:
    """Drop every mapping (torch closes the IPC handle and releases its counter once the last view goes), after
    the work queued on them finished."""
    devices = {t.device for t in mapped if t.is_cuda}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    mapped.clear()


async def _release(trainer: pb_grpc.TrainerStub, request: pb.MapWeightsRequest, share_id: str, mapped: int) -> None:
    try:
        await trainer.ReleaseWeightHandles(pb.ReleaseWeightHandlesRequest(
            run_id=request.run_id, handover_id=request.handover_id, share_id=share_id, mapped_buckets=mapped))
    except grpc.aio.AioRpcError as exc:  # the coordinator's CloseWeightHandover frees the buckets regardless
        log.warning("ReleaseWeightHandles to %s failed with %s: %s", request.trainer_address, exc.code().name,
                    exc.details())
