"""The broadcast weight source into a real SGLang server (CPU, float32) over a gloo weight-update group.

This process plays the trainer: it hosts the rendezvous and broadcasts the buckets as rank 0, exactly as
services/trainer/weights/broadcast_sender.py does, while the engine has the server join the group
(/init_weights_update_group, its ranks reaching the rendezvous through the engine's loopback TCPStore
bridge) and load each bucket (/update_weights_from_distributed, "flattened_bucket").
Generation then follows the new weights, the server's weight_version is the new version, and the engine
reports SGLang's checksum of what it serves. A group the trainer abandons (another rank will not join)
releases the engine before the server is asked to join anything. Every request body of the path is also built into SGLang's
own request types (sglang/srt/managers/io_struct.py), so a renamed or removed field fails.
"""
from __future__ import annotations

import threading

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.weights.broadcast_protocol import (
    GroupNotFormed,
    WeightUpdateGroup,
    bucket_specs,
    joined_key,
    pack_bucket,
    plan_buckets,
    plan_proto,
    tensor_spec,
)
from services.common.weights.files import write_weight_dir
from services.rollout.sglang.client import (
    init_weights_update_group_body,
    update_weights_from_distributed_body,
    weights_checksum_body,
)
from services.rollout.sglang.weights import load_checkpoint_tensors
from services.rollout.weights.broadcast_receiver import BroadcastReceiveFailed
from tests.rollout.sglang.test_sglang_engine import TOL, engine, gaps, make_request, model_dir  # noqa: F401 - fixtures
from tests.support.rendezvous import HostedRendezvous

pytestmark = pytest.mark.slow


@pytest.fixture
def rendezvous(engine):  # noqa: F811
    """The trainer's rendezvous with the group of the next version open."""
    with HostedRendezvous(f"g-{engine.policy_version + 1}") as hosted:
        yield hosted


def _plan(tensors: list[tuple[str, torch.Tensor]], version: int, address: str, **fields) -> pb.BroadcastPlan:
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors], 64 * 1024)
    return plan_proto(buckets, run_id="r", policy_version=version, group_name=f"g-{version}", rendezvous=address,
                      backend="gloo", world_size=2, **fields)


def _broadcast(store, plan: pb.BroadcastPlan, tensors, errors: list) -> None:
    try:
        group = WeightUpdateGroup(store, group_name=plan.group_name, rank=0, world_size=2, backend="gloo",
                                  timeout_s=300)
        start = 0
        for bucket in plan.buckets:
            group.broadcast(pack_bucket([t for _, t in tensors[start:start + len(bucket.tensors)]],
                                        torch.device("cpu")))
            start += len(bucket.tensors)
        group.close()
    except Exception as exc:  # noqa: BLE001 - reported to the test thread
        errors.append(exc)


def test_sglang_joins_a_gloo_group_and_serves_the_broadcast_weights(engine, model_dir, tmp_path,  # noqa: F811
                                                                    rendezvous):
    old_dir, v = engine.weights_path, engine.policy_version
    g = torch.Generator().manual_seed(21)
    tensors = [(k, t + 0.05 * torch.randn(t.shape, generator=g)) for k, t in load_checkpoint_tensors(old_dir).items()]
    store = rendezvous.client(300)
    plan = _plan(tensors, v + 1, rendezvous.address)
    assert len(plan.buckets) > 1
    request = pb.ReceiveWeightsRequest(plan=plan, rank=1)

    # Refused before the server joins anything: adapters, a digest trailer it cannot take, an old version.
    for field, value, reason in (("digest_trailer", True, "plan.digest_trailer"),
                                 ("policy_version", v, "not newer than the loaded")):
        bad = pb.ReceiveWeightsRequest()
        bad.CopyFrom(request)
        setattr(bad.plan, field, value)
        with pytest.raises(ValueError, match=reason):
            engine.receive_broadcast(bad, bucket_specs(bad.plan), store)
    lora = pb.ReceiveWeightsRequest()
    lora.CopyFrom(request)
    lora.plan.lora.CopyFrom(pb.LoraAdapter(rank=4, alpha=8.0, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="plan.lora"):
        engine.receive_broadcast(lora, bucket_specs(lora.plan), store)
    assert engine.policy_version == v

    before = engine._ready_client().weights_checksum()
    errors: list = []
    sender = threading.Thread(target=_broadcast, args=(rendezvous.local(300), plan, tensors, errors))
    sender.start()
    try:
        checksum = engine.receive_broadcast(request, bucket_specs(plan), store)
    finally:
        sender.join(timeout=600)
    assert not errors
    assert engine.policy_version == v + 1 and len(checksum) == 64 and checksum != before
    assert engine._ready_client().weight_version() == str(v + 1)

    written = write_weight_dir(tmp_path / "expected", tensors, v + 1, base_dir=model_dir)
    req = make_request(n=4)
    samples = engine.generate(req)
    assert gaps(str(written.directory), req, samples, 0.7).mean().item() <= TOL
    assert gaps(old_dir, req, samples, 0.7).mean().item() > 100 * TOL


def test_a_group_the_trainer_abandons_releases_the_engine_before_the_server_joins(engine, model_dir,  # noqa: F811
                                                                                  rendezvous):
    v = engine.policy_version
    tensors = list(load_checkpoint_tensors(str(model_dir)).items())
    store = rendezvous.local(300)
    plan = _plan(tensors, v + 1, rendezvous.address)
    plan.world_size = 3  # rank 2 never joins
    errors: list = []

    def trainer() -> None:
        # As the trainer does once the coordinator aborts: here as soon as rank 1 has announced itself.
        aborted = lambda: "aborted: rank 2: PERMISSION_DENIED" if store.check([joined_key(plan.group_name, 1)]) \
            else None  # noqa: E731
        try:
            WeightUpdateGroup(store, group_name=plan.group_name, rank=0, world_size=3, backend="gloo",
                              timeout_s=300, abort_reason=aborted)
        except GroupNotFormed as exc:
            errors.append(exc)

    sender = threading.Thread(target=trainer)
    sender.start()
    try:
        with pytest.raises(BroadcastReceiveFailed, match="rank 0 abandoned it: aborted: rank 2: PERMISSION_DENIED"):
            engine.receive_broadcast(pb.ReceiveWeightsRequest(plan=plan, rank=1), bucket_specs(plan),
                                     rendezvous.client(300))
    finally:
        sender.join(timeout=300)
    assert [str(e) for e in errors] == [f"group {plan.group_name}: rank 2 of 3 never joined: aborted: rank 2: "
                                        "PERMISSION_DENIED"]
    # Nothing changed and the server still serves (it never paused, never sat in a group's constructor).
    assert engine.policy_version == v and engine._ready_client().weight_version() == str(v)
    assert len(engine.generate(make_request(n=1, max_new_tokens=2))) == len(make_request(n=1).prompts)


def test_broadcast_request_bodies_fit_sglangs_request_types(sglang_request_types):
    names, dtypes, shapes = ["model.embed_tokens.weight", "model.norm.weight"], ["float32"] * 2, [[128, 32], [32]]
    bodies = [
        ("InitWeightsUpdateGroupReqInput", init_weights_update_group_body("10.0.0.1", 29500, 2, 3, "g-7", "gloo")),
        ("UpdateWeightsFromDistributedReqInput", update_weights_from_distributed_body(
            names, dtypes, shapes, None, "g-7", flush_cache=False, load_format="flattened_bucket")),
        ("UpdateWeightsFromDistributedReqInput", update_weights_from_distributed_body(
            names, dtypes, shapes, "7", "g-7", load_format="flattened_bucket")),
        ("DestroyWeightsUpdateGroupReqInput", {"group_name": "g-7"}),
        ("BeginWeightUpdateReqInput", {}),
        ("EndWeightUpdateReqInput", {}),
        ("CheckWeightsReqInput", weights_checksum_body()),
    ]
    # Each body becomes the type SGLang's HTTP handler decodes it into: an unknown field is a TypeError.
    for name, body in bodies:
        assert sglang_request_types.changed_fields(name, body) == [], name  # every field kept its value
