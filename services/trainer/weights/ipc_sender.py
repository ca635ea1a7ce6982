"""The trainer's side of the IPC weight source: one handover per sync, shared in place with replicas on its node.

OpenWeightHandover (under the servicer's lock, so no step changes the weights meanwhile) packs the current
weights into buckets of `bucket_bytes` on the weights' device (services/common/weights/ipc_transport.py),
issues a fresh handover id (a random token: the only way to ask for these handles) and starts hashing the
buckets on a pool, so that its digest is ready about when a replica's is. The coordinator learns the id,
version, sizes and node, never a handle.

GetWeightHandles is a replica's own call (authenticated like every call, to an address of its weight_sources):
it must name the run, version and handover id, run on this node and, for device buckets, see the device; it
gets a share of its own (for CUDA, torch's reference counters of its own: each replica's mapping is counted
until it drops it). VerifyWeightHandover returns the trainer's digest once ready, after recording the
replica's. ReleaseWeightHandles takes a replica's release: once every replica the handover was opened for
released its share, the buckets are freed (CUDA: torch frees a shared block once every counter is back to
zero; ipc_collect reclaims it). CloseWeightHandover (the coordinator, after the sync, whatever its outcome)
frees them in any case, dropping the counters of shares never released. Handles are never logged.
"""
from __future__ import annotations

import hmac
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from proto import lockstep_pb2 as pb
from services.common.process.structured_logging import log_event
from services.common.weights import ipc_transport as ipc
from services.common.weights.bucket_digest import BucketHasher
from services.trainer.data.wire import FailedPrecondition, InvalidRequest
from services.trainer.run_state import WeightSnapshot

# Handovers open at once: a coordinator closes each after its sync; a newer one replaces an older left open.
OPEN_HANDOVERS_KEPT = 1


class HandoverRefused(FailedPrecondition):
    """A GetWeightHandles / Verify / Release for no open handover of the run, or from a caller that cannot map
    it (another node, no view of its device): FAILED_PRECONDITION."""


@dataclass
class _Handover:
    run_id: str
    policy_version: int
    handover_id: str
    backend: str
    device_uuid: str
    replicas: int
    buffers: list[torch.Tensor]
    layouts: list[ipc.BucketLayout]
    digest: Future
    lora: pb.LoraAdapter | None
    unissued: list[list[pb.IpcBucket]] = field(default_factory=list)  # exported at open, one per replica
    shares: dict[str, list[pb.IpcBucket]] = field(default_factory=dict)  # share id -> what it was given
    released: set[str] = field(default_factory=set)
    verified: dict[str, bool] = field(default_factory=dict)

    def summary(self, node: str) -> pb.WeightHandover:
        return pb.WeightHandover(run_id=self.run_id, policy_version=self.policy_version, handover_id=self.handover_id,
                                 backend=self.backend, device_uuid=self.device_uuid, node_id=node,
                                 tensors=sum(len(lay.slots) for lay in self.layouts),
                                 bytes=sum(s.nbytes for lay in self.layouts for s in lay.slots),
                                 buckets=len(self.layouts))


def _warm_pack(device: str | None) -> None:
    """Pack a tiny master into a tiny bucket in every compute dtype: a first handover then loads no kernel
    module (CUDA loads one at its first launch) for the bucket's memset or the casts."""
    if device is None or torch.device(device).type != "cuda":
        return
    master = torch.zeros(64, device=device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        layouts = ipc.layout_of([("warm", master)], ipc.ALIGN_BYTES, dtype)
        ipc.pack(ipc.allocate(layouts[0].nbytes, torch.device(device)), layouts[0], [master])
    torch.cuda.synchronize(device)


class WeightHandoverHost:
    def __init__(self, trainer, *, bucket_bytes: int, logger, hash_threads: int | None = None,
                 digest_on: str = "host", device: str | None = None) -> None:
        self.trainer, self.bucket_bytes, self.log = trainer, bucket_bytes, logger
        self.node = ipc.node_id()
        self._lock = threading.Lock()  # guards _open: Get/Verify/Release run beside steps, off the servicer's lock
        self._open: dict[str, _Handover] = {}
        self._hasher = BucketHasher(hash_threads, on=digest_on)
        self._hasher.warm(device)  # the trainer's weights device, before any handover
        _warm_pack(device)
        self._digest_pool = ThreadPoolExecutor(1, thread_name_prefix="ipc-digest")

    def close(self) -> None:
        with self._lock:
            for handover in list(self._open.values()):
                self._free(handover)
            self._open.clear()
        self._digest_pool.shutdown(wait=True)
        self._hasher.close()

    # Under the servicer's lock.
    def open(self, request: pb.OpenWeightHandoverRequest) -> pb.WeightHandover:
        if request.replicas < 1:
            raise InvalidRequest(f"replicas: must be >= 1, got {request.replicas}")
        if request.bucket_bytes < 0 or 0 < request.bucket_bytes < ipc.ALIGN_BYTES:
            raise InvalidRequest(f"bucket_bytes: 0 (the trainer's weight_ipc_bucket_bytes) or >= {ipc.ALIGN_BYTES}, "
                                 f"got {request.bucket_bytes}")
        started = time.perf_counter()
        # The masters themselves, cast as they are packed: one pass over them, not a cast copy and then a pack.
        snapshot: WeightSnapshot = self.trainer.weight_tensors(request.run_id, cast=False)
        device = next((t.device for _, t in snapshot.tensors), torch.device("cpu"))
        layouts = ipc.layout_of(snapshot.tensors, request.bucket_bytes or self.bucket_bytes, snapshot.cast_to)
        buffers, start = [], 0
        for layout in layouts:
            buffer = ipc.allocate(layout.nbytes, device)
            ipc.pack(buffer, layout, [t for _, t in snapshot.tensors[start:start + len(layout.slots)]])
            start += len(layout.slots)
            buffers.append(buffer)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # packed before anyone maps or hashes them
        self.trainer.check_weights_unchanged(snapshot)
        packed = time.perf_counter()
        # Every replica's share is exported now, before the hashing starts reading the buffers: exporting a CUDA
        # share rewraps its storage's data pointer, which no other thread should be reading meanwhile.
        shares = []
        for _ in range(request.replicas):
            buckets = [ipc.layout_proto(layout) for layout in layouts]
            for buffer, bucket in zip(buffers, buckets):
                ipc.export(buffer, bucket)
            shares.append(buckets)
        exported = time.perf_counter()
        handover = _Handover(
            run_id=request.run_id, policy_version=snapshot.policy_version, handover_id=secrets.token_hex(16),
            backend=ipc.backend_for(device), device_uuid=ipc.device_uuid(device.index or 0) if device.type == "cuda"
            else "", replicas=request.replicas, buffers=buffers, layouts=layouts,
            digest=self._digest_pool.submit(self._hasher.digest, list(buffers), layouts),
            lora=snapshot.lora.to_proto() if snapshot.lora is not None else None, unissued=shares)
        with self._lock:
            self._open[handover.handover_id] = handover
            while len(self._open) > OPEN_HANDOVERS_KEPT:
                self._free(self._open.pop(next(iter(self._open))))
        summary = handover.summary(self.node)
        log_event(self.log, "weight handover opened", run_id=summary.run_id, policy_version=summary.policy_version,
                  backend=summary.backend, buckets=summary.buckets, bytes=summary.bytes, replicas=request.replicas,
                  phases_ms={"pack": round((packed - started) * 1e3, 2), "export": round((exported - packed) * 1e3, 2)})
        handover.digest.add_done_callback(lambda done: self._hashed(summary, exported, done))
        return summary

    def _hashed(self, summary: pb.WeightHandover, since: float, done: Future) -> None:
        """The handover's digest finished (or was cancelled, or failed): how long it took from the export on."""
        if done.cancelled() or done.exception() is not None:
            return  # a failure reaches the replica through VerifyWeightHandover
        log_event(self.log, "weight handover hashed", run_id=summary.run_id, policy_version=summary.policy_version,
                  phases_ms={"digest": round((time.perf_counter() - since) * 1e3, 2)})

    def _find(self, run_id: str, handover_id: str) -> _Handover:
        """Under self._lock. The open handover of that id and run (compared in constant time), or refused."""
        for key, handover in self._open.items():
            if hmac.compare_digest(key.encode(), handover_id.encode()) and handover.run_id == run_id:
                return handover
        raise HandoverRefused(f"handover_id: no open weight handover of run {run_id!r} has that id")

    def handles(self, request: pb.GetWeightHandlesRequest) -> pb.WeightHandles:
        with self._lock:
            handover = self._find(request.run_id, request.handover_id)
            if request.policy_version != handover.policy_version:
                raise HandoverRefused(f"policy_version: the handover holds version {handover.policy_version}, not "
                                      f"{request.policy_version}")
            if request.node_id != self.node:
                raise HandoverRefused(f"node_id: the caller runs on node {request.node_id!r}, the trainer on "
                                      f"{self.node!r}; IPC handles open on one node only")
            if handover.backend == "cuda" and handover.device_uuid not in request.device_uuids:
                raise HandoverRefused(f"device_uuids: the buckets lie on {handover.device_uuid}, which the caller "
                                      f"does not see")
            if not handover.unissued:
                raise HandoverRefused(f"handover_id: all {handover.replicas} shares of the handover were handed out")
            share_id = secrets.token_hex(8)
            buckets = handover.unissued.pop()
            handover.shares[share_id] = buckets
            return pb.WeightHandles(
                run_id=handover.run_id, policy_version=handover.policy_version, handover_id=handover.handover_id,
                share_id=share_id, backend=handover.backend, device_uuid=handover.device_uuid, node_id=self.node,
                buckets=buckets, tensors=sum(len(b.tensors) for b in buckets),
                bytes=sum(s.nbytes for lay in handover.layouts for s in lay.slots), lora=handover.lora)

    def verify(self, request: pb.VerifyWeightHandoverRequest) -> pb.VerifyWeightHandoverResponse:
        with self._lock:
            handover = self._find(request.run_id, request.handover_id)
            self._share(handover, request.share_id)
        digest = handover.digest.result()  # off the lock: the pool may still be hashing
        with self._lock:
            handover.verified[request.share_id] = hmac.compare_digest(digest, request.total_sha256)
        return pb.VerifyWeightHandoverResponse(total_sha256=digest)

    def release(self, request: pb.ReleaseWeightHandlesRequest) -> pb.ReleaseWeightHandlesResponse:
        with self._lock:
            handover = self._find(request.run_id, request.handover_id)
            buckets = self._share(handover, request.share_id)
            if not 0 <= request.mapped_buckets <= len(buckets):
                raise InvalidRequest(f"mapped_buckets: {request.mapped_buckets} of a share of {len(buckets)} buckets")
            if request.share_id not in handover.released:
                handover.released.add(request.share_id)
                for bucket in buckets[request.mapped_buckets:]:  # never mapped: nobody will drop these counters but us
                    ipc.drop_share(bucket)
            outstanding = handover.replicas - len(handover.released)
            if outstanding == 0:
                self._free(self._open.pop(handover.handover_id))
        return pb.ReleaseWeightHandlesResponse(outstanding=outstanding)

    def close_handover(self, request: pb.CloseWeightHandoverRequest) -> pb.CloseWeightHandoverResponse:
        with self._lock:
            try:
                handover = self._find(request.run_id, request.handover_id)
            except HandoverRefused:
                return pb.CloseWeightHandoverResponse(unreleased=0)  # freed already: every share was released
            self._open.pop(handover.handover_id)
            unreleased = self._free(handover)
        return pb.CloseWeightHandoverResponse(unreleased=unreleased)

    @staticmethod
    def _share(handover: _Handover, share_id: str) -> list[pb.IpcBucket]:
        for key, buckets in handover.shares.items():
            if hmac.compare_digest(key.encode(), share_id.encode()):
                return buckets
        raise HandoverRefused("share_id: not a share of this handover")

    def _free(self, handover: _Handover) -> int:
        """Drop the buckets (and the counters of shares never released). The number of such shares."""
        unreleased = [s for s in handover.shares if s not in handover.released]
        for buckets in [*(handover.shares[s] for s in unreleased), *handover.unissued]:
            for bucket in buckets:
                ipc.drop_share(bucket)
        handover.unissued.clear()
        device_buckets = bool(handover.buffers) and handover.buffers[0].is_cuda
        handover.digest.cancel()
        handover.buffers.clear()
        if device_buckets:
            torch.cuda.ipc_collect()  # frees shared blocks whose every counter is back to zero
        log_event(self.log, "weight handover closed", run_id=handover.run_id, policy_version=handover.policy_version,
                  shares=len(handover.shares), unreleased=len(unreleased))
        return len(unreleased)
