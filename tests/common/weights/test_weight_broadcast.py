"""The broadcast weight source's pieces: the bucket plan (pure), packing, plan checks, and a real gloo
group between two threads of this process (the trainer's side sending, a replica's side receiving), met
at a rendezvous served as the trainer serves it (tests/support/rendezvous.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.auth import BearerToken, generate_token
from services.common.weights.broadcast_protocol import (
    TensorSpec,
    WeightUpdateGroup,
    bucket_specs,
    hash_buffer,
    pack_bucket,
    plan_buckets,
    plan_proto,
    tensor_spec,
    unpack_bucket,
)
from services.common.weights.digest import BlockDigests
from services.common.weights.stream import iter_weight_chunks
from services.rollout.weights.broadcast_receiver import (
    BroadcastReceiveFailed, checked_plan, receive_broadcast, staging_device,
)
from tests.support.rendezvous import HostedRendezvous


def _spec(name: str, dtype: str, nbytes: int) -> TensorSpec:
    item = {"float32": 4, "bfloat16": 2}[dtype]
    return TensorSpec(name, dtype, (nbytes // item,), nbytes)


def _names(buckets):
    return [[s.name for s in b] for b in buckets]


def test_buckets_are_runs_of_one_dtype_within_the_size_in_order():
    specs = [_spec("a", "float32", 40), _spec("b", "float32", 40), _spec("c", "float32", 40),
             _spec("d", "bfloat16", 20), _spec("e", "float32", 8)]
    assert _names(plan_buckets(specs, 80)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert _names(plan_buckets(specs, 1 << 20)) == [["a", "b", "c"], ["d"], ["e"]]
    # A tensor larger than the bucket size is a bucket of its own, never split.
    assert _names(plan_buckets([_spec("small", "float32", 4), _spec("big", "float32", 400),
                                _spec("tail", "float32", 4)], 100)) == [["small"], ["big"], ["tail"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(specs, 0)


def _model_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(8, 4, generator=g)), ("norm.weight", torch.randn(4, generator=g)),
            ("mask", torch.randn(3, 2, generator=g).to(torch.bfloat16)), ("head.weight", torch.randn(5, 4, generator=g))]


def test_packed_buckets_unpack_to_the_tensors_and_hash_as_the_grpc_stream():
    tensors = _model_tensors()
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors], 160)
    assert _names(buckets) == [["embed.weight", "norm.weight"], ["mask"], ["head.weight"]]
    digest, out, start = BlockDigests(), {}, 0
    for bucket in buckets:
        buffer = pack_bucket([t for _, t in tensors[start:start + len(bucket)]], torch.device("cpu"))
        start += len(bucket)
        assert buffer.dtype == torch.uint8 and buffer.numel() == sum(s.nbytes for s in bucket)
        hash_buffer(digest, buffer, [(spec.name, spec.nbytes) for spec in bucket])
        out.update(unpack_bucket(buffer, bucket))
    assert list(out) == [n for n, _ in tensors]
    assert all(torch.equal(out[n], t) and out[n].dtype == t.dtype for n, t in tensors)
    stream = list(iter_weight_chunks(tensors, run_id="r", policy_version=1, chunk_bytes=7))
    assert digest.hexdigest() == stream[-1].total_sha256


def _plan(tensors, bucket_bytes: int, **fields) -> pb.BroadcastPlan:
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors], bucket_bytes)
    return plan_proto(buckets, run_id="r", policy_version=3, group_name="g", backend="gloo", world_size=2,
                      digest_trailer=True, **fields)


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda p: p.buckets[0].tensors.add(name="x", dtype="bfloat16", shape=[1]), "more than one dtype"),
    (lambda p: setattr(p.buckets[0], "nbytes", 1), r"buckets\[0\].nbytes: 1, but its tensors hold 144"),
    (lambda p: setattr(p.buckets[1].tensors[0], "name", "embed.weight"), "empty or repeated"),
    (lambda p: p.buckets[2].tensors[0].shape.append(-1), "negative dimension"),
    (lambda p: setattr(p.buckets[1].tensors[0], "dtype", "complex64"), r"buckets\[1\].tensors\[0\].dtype"),
    (lambda p: setattr(p, "bytes", 1), "do not match the buckets"),
])
def test_a_plan_that_does_not_add_up_is_refused_naming_the_field(edit, reason):
    plan = _plan(_model_tensors(), 160)
    bucket_specs(plan)
    edit(plan)
    with pytest.raises(ValueError, match=reason):
        bucket_specs(plan)


@pytest.mark.parametrize(("fields", "rank", "reason"), [
    ({"backend": "mpi"}, 1, "plan.backend"),
    ({}, 2, "rank: need 0 < rank < plan.world_size, got 2 of 2"),
    ({}, 0, "rank"),
    ({"digest_trailer": False}, 1, "plan.digest_trailer: required"),
    ({"group_name": ""}, 1, "plan.group_name"),
])
def test_a_replica_refuses_a_plan_it_cannot_receive(fields, rank, reason):
    plan = _plan(_model_tensors(), 160)
    for key, value in fields.items():
        setattr(plan, key, value)
    with pytest.raises(ValueError, match=reason):
        checked_plan(pb.ReceiveWeightsRequest(plan=plan, rank=rank))


def test_nccl_needs_a_cuda_engine_device_and_gloo_stages_in_host_memory():
    with pytest.raises(ValueError, match="'nccl' needs a CUDA"):
        staging_device("nccl", torch.device("cpu"))
    assert staging_device("gloo", torch.device("cpu")) == torch.device("cpu")


def _send(store, plan: pb.BroadcastPlan, tensors, trailer: bytes | None, errors: list) -> None:
    """Rank 0 as the trainer runs it: every bucket, then the trailer (the digest of what was sent, or `trailer`)."""
    try:
        group = WeightUpdateGroup(store, group_name=plan.group_name, rank=0, world_size=2, backend="gloo",
                                  timeout_s=60)
        digest, start = BlockDigests(), 0
        for bucket in plan.buckets:
            sent = tensors[start:start + len(bucket.tensors)]
            buffer = pack_bucket([t for _, t in sent], torch.device("cpu"))
            start += len(bucket.tensors)
            group.broadcast(buffer)
            hash_buffer(digest, buffer, [(n, t.numel() * t.element_size()) for n, t in sent])
        group.broadcast(torch.frombuffer(bytearray(trailer or bytes.fromhex(digest.hexdigest())), dtype=torch.uint8))
        group.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(exc)


@pytest.mark.parametrize("tampered", [False, True])
def test_a_replica_applies_nothing_unless_the_trainers_digest_matches(tampered):
    tensors = _model_tensors()
    with HostedRendezvous("g") as rendezvous:
        plan = _plan(tensors, 160, rendezvous=rendezvous.address)
        errors: list = []
        sender = threading.Thread(target=_send, args=(rendezvous.local(60), plan, tensors,
                                                      b"\0" * 32 if tampered else None, errors))
        sender.start()
        try:
            _receive_checked(plan, rendezvous.client(60), tensors, tampered)
        finally:
            sender.join(timeout=120)
    assert not errors


def _receive_checked(plan: pb.BroadcastPlan, store, tensors, tampered: bool) -> None:
    request = pb.ReceiveWeightsRequest(plan=plan, rank=1)
    if tampered:
        with pytest.raises(BroadcastReceiveFailed, match="received bytes hash to .* nothing applied"):
            receive_broadcast(request, checked_plan(request), torch.device("cpu"), store, 60)
    else:
        got = receive_broadcast(request, checked_plan(request), torch.device("cpu"), store, 60)
        assert list(got.tensors) == [n for n, _ in tensors] and got.lora is None
        assert all(torch.equal(got.tensors[n], t) for n, t in tensors)
        stream = list(iter_weight_chunks(tensors, run_id="r", policy_version=3))
        assert got.total_sha256 == stream[-1].total_sha256 and got.nbytes == plan.bytes


def test_a_group_that_never_forms_fails_within_the_timeout():
    with HostedRendezvous("g") as rendezvous:
        plan = _plan(_model_tensors(), 160, rendezvous=rendezvous.address)
        request = pb.ReceiveWeightsRequest(plan=plan, rank=1)
        # Rank 0 never joins: the replica gives up after its timeout rather than waiting forever.
        with pytest.raises(BroadcastReceiveFailed, match="rank 1 of 2"):
            receive_broadcast(request, checked_plan(request), torch.device("cpu"), rendezvous.client(2), 2)


def test_a_trainer_refuses_broadcasts_it_is_not_configured_or_asked_for_properly():
    import logging

    from services.trainer.weights.broadcast_sender import WeightBroadcaster
    from services.trainer.data.wire import FailedPrecondition, InvalidRequest

    log, token = logging.getLogger("test"), BearerToken(generate_token())
    # The refusals come before the trainer's weights are touched: no run is needed to see them.
    unconfigured = WeightBroadcaster(None, address="", token=token, bucket_bytes=1024, timeout_s=5, logger=log)
    with pytest.raises(FailedPrecondition, match="no weight_broadcast_address configured"):
        unconfigured.open(pb.OpenWeightBroadcastRequest(run_id="r", replicas=2))
    configured = WeightBroadcaster(None, address="127.0.0.1:29500", token=token, bucket_bytes=1024, timeout_s=5,
                                   logger=log)
    with pytest.raises(InvalidRequest, match="replicas: must be >= 1"):
        configured.open(pb.OpenWeightBroadcastRequest(run_id="r", replicas=0))
    with pytest.raises(InvalidRequest, match="bucket_bytes: must be >= 0"):
        configured.open(pb.OpenWeightBroadcastRequest(run_id="r", replicas=1, bucket_bytes=-1))
    with pytest.raises(FailedPrecondition, match="no open broadcast of run 'r'"):
        configured.run(pb.RunWeightBroadcastRequest(run_id="r", group_name="lockstep-weights-unknown"))
