"""The trainer's side of the broadcast weight source: it is rank 0 of one weight-update group per sync.

OpenWeightBroadcast plans the current weights into buckets (services.common.weights.broadcast_protocol) and
names a fresh group, which opens in the trainer's rendezvous; nothing moves. The rendezvous
(services/common/rendezvous/service.py) is served from the trainer's start on its configured
weight_broadcast_address only (never one a request names), to callers holding the deployment's token.
RunWeightBroadcast then waits there for every rank, broadcasts each bucket and answers the digest of
what it sent; the group closes when it ends, whole or failed, and its keys go with it. Both run under
the servicer's lock, so the weights cannot change between the plan and the last bucket; a plan whose
weights did change is refused.

AbortWeightBroadcast (beside a running broadcast, so never under that lock) tells a group that has not
formed yet to give up: the coordinator sends it once a replica's ReceiveWeights failed, since a rank that
will never join would otherwise keep the trainer (and the ranks that did join) waiting the whole timeout.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

from proto import lockstep_pb2 as pb
from services.common.auth import BearerToken
from services.common.process.structured_logging import log_event
from services.common.rendezvous.key_table import KeyTable, RendezvousLimits
from services.common.rendezvous.service import RendezvousServer
from services.common.rendezvous.store import LocalStore
from services.common.weights.broadcast_protocol import (
    WeightUpdateGroup,
    abandon_group,
    abandoned_key,
    hash_buffer,
    pack_bucket,
    plan_buckets,
    plan_proto,
    tensor_spec,
)
from services.common.weights.digest import BlockDigests
from services.trainer.data.wire import FailedPrecondition, InvalidRequest
from services.trainer.run_state import WeightSnapshot

# Plans kept for RunWeightBroadcast. A coordinator runs a plan right after opening it, and a plan holds
# its snapshot (a compute-dtype copy of the policy) until then: a newer plan replaces an unrun one.
OPEN_PLANS_KEPT = 1
# An abort's reason is logged and carried into the broadcast's error: long enough for every replica's error.
MAX_ABORT_REASON_CHARS = 16_384


class BroadcastFailed(RuntimeError):
    """The group did not form (a rank never joined) or a bucket did not go through; the replicas apply
    nothing of a broadcast they did not receive whole."""


@dataclass
class _OpenPlan:
    snapshot: WeightSnapshot
    plan: pb.BroadcastPlan
    buckets: list[list[int]]  # indices into snapshot.tensors, per bucket
    abort_reason: str | None = None  # set by AbortWeightBroadcast before the group formed


class WeightBroadcaster:
    """`address`: the host:port this trainer's rendezvous listens on and replicas reach it at; empty refuses
    the source. start() begins serving it (an address this host cannot listen on fails the start)."""

    def __init__(self, trainer, *, address: str, token: BearerToken, bucket_bytes: int, timeout_s: float, logger,
                 limits: RendezvousLimits = RendezvousLimits()) -> None:
        self.trainer = trainer
        self.address, self.bucket_bytes, self.timeout_s = address, bucket_bytes, timeout_s
        self.log = logger
        self.keys = KeyTable(limits)
        self._server = RendezvousServer(self.keys, token, address, field="weight_broadcast_address") \
            if address else None
        # Guards _open and _forming, which AbortWeightBroadcast reads beside a running broadcast.
        self._plans_lock = threading.Lock()
        self._open: OrderedDict[str, _OpenPlan] = OrderedDict()
        self._forming: dict[str, _OpenPlan] = {}  # running, not past the join barrier yet

    def open(self, request: pb.OpenWeightBroadcastRequest) -> pb.BroadcastPlan:
        if not self.address:
            raise FailedPrecondition("OpenWeightBroadcast: this trainer has no weight_broadcast_address configured")
        if request.replicas < 1:
            raise InvalidRequest(f"replicas: must be >= 1, got {request.replicas}")
        if request.bucket_bytes < 0:
            raise InvalidRequest(f"bucket_bytes: must be >= 0, got {request.bucket_bytes}")
        snapshot = self.trainer.weight_tensors(request.run_id)
        specs = [tensor_spec(name, t) for name, t in snapshot.tensors]
        buckets = plan_buckets(specs, request.bucket_bytes or self.bucket_bytes)
        on_cuda = any(t.is_cuda for _, t in snapshot.tensors)
        group_name = f"lockstep-weights-{uuid.uuid4().hex[:12]}"
        plan = plan_proto(buckets, run_id=request.run_id, policy_version=snapshot.policy_version,
                          group_name=group_name, rendezvous=self.address, backend="nccl" if on_cuda else "gloo",
                          world_size=request.replicas + 1, digest_trailer=request.digest_trailer,
                          lora=snapshot.lora.to_proto() if snapshot.lora is not None else None)
        indices, start = [], 0
        for bucket in buckets:
            indices.append(list(range(start, start + len(bucket))))
            start += len(bucket)
        with self._plans_lock:
            self.keys.open_group(group_name)
            self._open[group_name] = _OpenPlan(snapshot, plan, indices)
            while len(self._open) > OPEN_PLANS_KEPT:
                replaced, _ = self._open.popitem(last=False)
                self.keys.close_group(replaced, f"replaced by the newer plan {group_name}")
        return plan

    def abort(self, request: pb.AbortWeightBroadcastRequest) -> pb.AbortWeightBroadcastResponse:
        """Tell the run's group, open or waiting for its ranks, to give up: RunWeightBroadcast then fails
        (BroadcastFailed naming the ranks that never joined and `reason`) instead of waiting out its
        timeout; one whose ranks all joined meanwhile forms regardless. A group that is unknown, of another
        run, finished or already broadcasting is left as it is (aborted false): the broadcast of a formed
        group ends by itself, whole or failed."""
        if not request.reason:
            raise InvalidRequest("reason: required (why the group is given up; the broadcast's error names it)")
        if len(request.reason) > MAX_ABORT_REASON_CHARS:
            raise InvalidRequest(f"reason: {len(request.reason)} characters, at most {MAX_ABORT_REASON_CHARS}")
        with self._plans_lock:
            target = self._open.get(request.group_name) or self._forming.get(request.group_name)
            if target is None or target.plan.run_id != request.run_id:
                return pb.AbortWeightBroadcastResponse(aborted=False)
            target.abort_reason = f"aborted: {request.reason}"
        log_event(self.log, "weight broadcast aborted", run_id=request.run_id, group_name=request.group_name,
                  reason=request.reason)
        return pb.AbortWeightBroadcastResponse(aborted=True)

    def start(self) -> None:
        """Serve the rendezvous (OSError naming weight_broadcast_address when it cannot listen there)."""
        if self._server is not None:
            self._server.start()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop(grace_s=0)

    def _abort_reason(self, opened: _OpenPlan) -> str | None:
        with self._plans_lock:
            return opened.abort_reason

    def run(self, request: pb.RunWeightBroadcastRequest) -> pb.UpdateWeightsResponse:
        with self._plans_lock:
            opened = self._open.pop(request.group_name, None)
            if opened is None or opened.plan.run_id != request.run_id:
                raise FailedPrecondition(f"group_name: {request.group_name!r} is no open broadcast of run "
                                         f"{request.run_id!r} (OpenWeightBroadcast first)")
            self._forming[request.group_name] = opened
        outcome = "finished"
        try:
            return self._run(opened)
        except Exception as exc:
            outcome = f"failed: {exc}"
            raise
        finally:
            with self._plans_lock:
                self._forming.pop(request.group_name, None)
            # Every rank is done with the store once rank 0 is; a rank still waiting learns why: the reason
            # the group was abandoned for, when it was.
            abandoned = self.keys.get(abandoned_key(request.group_name))
            self.keys.close_group(request.group_name, abandoned.decode(errors="replace") if abandoned else outcome)

    def _run(self, opened: _OpenPlan) -> pb.UpdateWeightsResponse:
        plan, tensors = opened.plan, opened.snapshot.tensors
        device = next(t.device for _, t in tensors) if plan.backend == "nccl" else torch.device("cpu")
        digest = BlockDigests()
        store = LocalStore(self.keys, self.timeout_s)
        try:
            self.trainer.check_weights_unchanged(opened.snapshot)
        except FailedPrecondition as exc:
            abandon_group(store, plan.group_name, str(exc))  # the replicas waiting for the group stop now
            raise
        try:
            group = WeightUpdateGroup(store, group_name=plan.group_name, rank=0, world_size=plan.world_size,
                                      backend=plan.backend, timeout_s=self.timeout_s,
                                      abort_reason=lambda: self._abort_reason(opened))
            with self._plans_lock:
                self._forming.pop(plan.group_name, None)  # formed: an abort no longer applies
            try:
                for bucket in opened.buckets:
                    buffer = pack_bucket([tensors[i][1] for i in bucket], device)
                    group.broadcast(buffer)
                    hash_buffer(digest, buffer, [(tensors[i][0], tensors[i][1].numel() * tensors[i][1].element_size())
                                                 for i in bucket])
                if plan.digest_trailer:
                    trailer = bytearray(bytes.fromhex(digest.hexdigest()))
                    group.broadcast(torch.frombuffer(trailer, dtype=torch.uint8).to(device))
            finally:
                group.close()
        except RuntimeError as exc:  # torch.distributed's errors: a timeout, a peer that went away
            raise BroadcastFailed(f"broadcast {plan.group_name} of version {plan.policy_version} to "
                                  f"{plan.world_size - 1} replicas failed: {exc}") from exc
        log_event(self.log, "weights broadcast", run_id=plan.run_id, policy_version=plan.policy_version,
                  group_name=plan.group_name, world_size=plan.world_size, buckets=len(opened.buckets),
                  bytes=plan.bytes, backend=plan.backend)
        return pb.UpdateWeightsResponse(policy_version=plan.policy_version, tensors=plan.tensors, bytes=plan.bytes,
                                        total_sha256=digest.hexdigest())
