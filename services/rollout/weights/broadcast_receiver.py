"""A replica's side of the broadcast weight source, for engines that hold their model in this process.

The replica joins the plan's group at the trainer's rendezvous as its rank, through a RendezvousClient
carrying the deployment's token (services/common/rendezvous/store.py), announcing itself at the join
barrier first, so a group the trainer gives up on releases it at once. It receives every bucket into a
staging buffer of its own (the served model is untouched meanwhile), hashes what arrived, compares that
with the digest the trainer broadcasts after the last bucket, and only then hands the tensors to the
engine's ordinary update path (update_weights / update_lora_adapter), which checks them against the
model and applies them all or nothing. A group that does not form or a bucket that does not
arrive, or a digest that differs, raises BroadcastReceiveFailed and nothing is applied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from proto import lockstep_pb2 as pb
from services.common.rendezvous.store import BlockingStore
from services.common.weights.broadcast_protocol import (
    BACKENDS,
    TensorSpec,
    WeightUpdateGroup,
    bucket_specs,
    hash_buffer,
    join_when_formed,
    unpack_bucket,
)
from services.common.weights.digest import BlockDigests
from services.common.weights.stream import LoraAdapterMeta


class BroadcastReceiveFailed(RuntimeError):
    """The group did not form or a bucket did not arrive; nothing of the broadcast was applied."""


@dataclass
class ReceivedWeights:
    tensors: dict[str, torch.Tensor]
    nbytes: int
    total_sha256: str  # the weights digest of the received tensors in plan order (the GetWeights stream's)
    lora: LoraAdapterMeta | None


def checked_plan(request: pb.ReceiveWeightsRequest) -> list[list[TensorSpec]]:
    """The plan's buckets once rank, world size and backend make sense; ValueError naming the field."""
    plan = request.plan
    if plan.backend not in BACKENDS:
        raise ValueError(f"plan.backend: {plan.backend!r} is not one of {list(BACKENDS)}")
    if plan.world_size < 2 or not 0 < request.rank < plan.world_size:
        raise ValueError(f"rank: need 0 < rank < plan.world_size, got {request.rank} of {plan.world_size}")
    if not plan.group_name:
        raise ValueError("plan.group_name: empty")
    if plan.HasField("lora"):
        LoraAdapterMeta.from_proto(plan.lora)
    if not plan.digest_trailer:
        raise ValueError("plan.digest_trailer: required; a replica receiving in-process verifies the trainer's "
                         "digest of the broadcast before applying it")
    return bucket_specs(plan)


def staging_device(backend: str, engine_device: torch.device) -> torch.device:
    """Where buckets land: the engine's CUDA device under NCCL, host memory under gloo."""
    if backend == "nccl":
        if engine_device.type != "cuda":
            raise ValueError(f"plan.backend: 'nccl' needs a CUDA (or ROCm) engine device, this engine runs on "
                             f"{engine_device}")
        return engine_device
    return torch.device("cpu")


def await_group_formed(request: pb.ReceiveWeightsRequest, store: BlockingStore, timeout_s: float) -> None:
    """For a rank that another process holds (an SGLang server): announce the request's rank at the plan's
    join barrier in `store` (the plan's rendezvous) and return once the trainer saw every rank, so the
    server is only asked to join a group that will form. BroadcastReceiveFailed when the trainer gave up."""
    plan = request.plan
    try:
        join_when_formed(store, plan.group_name, request.rank, timeout_s=timeout_s)
    except RuntimeError as exc:  # GroupNotFormed; RendezvousError: refused, or the rendezvous unreachable
        raise BroadcastReceiveFailed(f"broadcast {plan.group_name} from {plan.rendezvous} (rank {request.rank} of "
                                     f"{plan.world_size}): {exc}") from exc


def receive_broadcast(request: pb.ReceiveWeightsRequest, buckets: list[list[TensorSpec]], device: torch.device,
                      store: BlockingStore, timeout_s: float) -> ReceivedWeights:
    """Join the plan's group through `store` (the plan's rendezvous) as the request's rank and receive it."""
    plan = request.plan
    digest = BlockDigests()
    tensors: dict[str, torch.Tensor] = {}
    try:
        group = WeightUpdateGroup(store, group_name=plan.group_name, rank=request.rank,
                                  world_size=plan.world_size, backend=plan.backend, timeout_s=timeout_s)
        try:
            for bucket in buckets:
                buffer = torch.empty(sum(s.nbytes for s in bucket), dtype=torch.uint8, device=device)
                group.broadcast(buffer)
                hash_buffer(digest, buffer, [(spec.name, spec.nbytes) for spec in bucket])
                tensors.update(unpack_bucket(buffer, bucket))
            sent = torch.empty(32, dtype=torch.uint8, device=device)
            group.broadcast(sent)
        finally:
            group.close()
    except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer that went away), RendezvousError
        raise BroadcastReceiveFailed(f"broadcast {plan.group_name} from {plan.rendezvous} (rank {request.rank} of "
                                     f"{plan.world_size}): {exc}") from exc
    if bytes(sent.cpu().numpy()) != bytes.fromhex(digest.hexdigest()):
        raise BroadcastReceiveFailed(f"broadcast {plan.group_name}: received bytes hash to {digest.hexdigest()}, the "
                                     f"trainer sent {bytes(sent.cpu().numpy()).hex()}; nothing applied")
    lora = LoraAdapterMeta.from_proto(plan.lora) if plan.HasField("lora") else None
    return ReceivedWeights(tensors, int(plan.bytes), digest.hexdigest(), lora)
