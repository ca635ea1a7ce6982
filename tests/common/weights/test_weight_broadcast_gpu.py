"""The broadcast weight source over real NCCL (gpu marker: run on a 2-GPU machine).

NCCL refuses two ranks on one GPU, so the trainer's side (rank 0, cuda:0) and a replica's side
(rank 1, cuda:1) run in two threads of this process: the plan, the bf16 buckets, the digest trailer and
the staging on the replica's device are those of a real sync, and NCCL's unique id crosses the
rendezvous as the trainer serves it: rank 0 reads it in process, rank 1 over gRPC with the token.

Run on a machine with two GPUs: `python -m pytest -q -m gpu tests/common/weights/test_weight_broadcast_gpu.py`."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.weights.broadcast_protocol import (
    WeightUpdateGroup,
    hash_buffer,
    pack_bucket,
    plan_buckets,
    plan_proto,
    tensor_spec,
)
from services.common.weights.digest import BlockDigests
from services.common.weights.stream import iter_weight_chunks
from services.rollout.weights.broadcast_receiver import checked_plan, receive_broadcast, staging_device
from tests.support.rendezvous import HostedRendezvous

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts


def test_bf16_buckets_cross_two_gpus_and_verify_against_the_trainers_digest():
    g = torch.Generator().manual_seed(0)
    cpu = [(f"layers.{i}.weight", torch.randn(256, 128, generator=g).to(torch.bfloat16)) for i in range(6)]
    cpu.append(("norm.weight", torch.randn(128, generator=g)))
    sender_side = [(n, t.to("cuda:0")) for n, t in cpu]
    with HostedRendezvous("gpu") as rendezvous:
        got, errors = _broadcast(rendezvous, cpu, sender_side)
    assert not errors
    assert all(t.device == torch.device("cuda:1") for t in got.tensors.values())
    assert all(torch.equal(got.tensors[n].cpu(), t) and got.tensors[n].dtype == t.dtype for n, t in cpu)
    assert got.total_sha256 == list(iter_weight_chunks(cpu, run_id="r", policy_version=1))[-1].total_sha256


def _broadcast(rendezvous: HostedRendezvous, cpu, sender_side):
    address = rendezvous.address
    buckets = plan_buckets([tensor_spec(n, t) for n, t in sender_side], 3 * 256 * 128 * 2)
    plan = plan_proto(buckets, run_id="r", policy_version=1, group_name="gpu", rendezvous=address, backend="nccl",
                      world_size=2, digest_trailer=True)
    assert [len(b.tensors) for b in plan.buckets] == [3, 3, 1]
    errors: list = []

    def send() -> None:
        try:
            torch.cuda.set_device(0)
            group = WeightUpdateGroup(rendezvous.local(120), group_name="gpu", rank=0, world_size=2, backend="nccl",
                                      timeout_s=120)
            digest, start = BlockDigests(), 0
            for bucket in plan.buckets:
                sent = sender_side[start:start + len(bucket.tensors)]
                buffer = pack_bucket([t for _, t in sent], torch.device("cuda:0"))
                start += len(bucket.tensors)
                group.broadcast(buffer)
                hash_buffer(digest, buffer, [(n, t.numel() * t.element_size()) for n, t in sent])
            trailer = bytearray(bytes.fromhex(digest.hexdigest()))
            group.broadcast(torch.frombuffer(trailer, dtype=torch.uint8).to("cuda:0"))
            group.close()
        except Exception as exc:  # noqa: BLE001 - reported to the test thread
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        request = pb.ReceiveWeightsRequest(plan=plan, rank=1)
        device = staging_device("nccl", torch.device("cuda:1"))
        got = receive_broadcast(request, checked_plan(request), device, rendezvous.client(120), 120)
    finally:
        sender.join(timeout=180)
    return got, errors
