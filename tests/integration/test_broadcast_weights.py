"""The broadcast weight source (rollout.weight_sync: broadcast) through the real stack, over gloo on CPU.

Each sync, the trainer (rank 0) and both torch replicas (ranks 1 and 2) form one torch.distributed group
at the trainer's configured rendezvous; the trainer broadcasts the policy in buckets and then their
digest, each replica checks that digest against its own over what arrived before applying. Checked with
real processes: a run completes with metrics bitwise those of the gRPC source, both replicas report the
digests the gRPC stream carries for the same versions, and a replica refuses a rendezvous it was not
configured to trust and a plan it cannot verify, without changing the weights it serves.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.grpc_options import sync_channel
from services.common.tiny_model import build_model_dir
from services.local_stack import LocalStack

pytestmark = pytest.mark.slow


def _spec(model: Path, name: str, weight_sync: str) -> dict:
    return {"name": name, "model_path": str(model), "seed": 5, "steps": 3,
            "task": {"name": "arithmetic", "options": {"heldout_size": 4}},
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4, "sampling": {"max_new_tokens": 4},
                        "weight_sync": weight_sync},
            "eval": {"every": 0, "heldout_size": 4}}


def _events(client, run_id: str, name: str) -> list[dict]:
    return [e for e in client.run(run_id)["events"] if e["event"] == name]


def _synced(client, run_id: str) -> list[tuple[int, str, int, list[str]]]:
    return [(e["policy_version"], e["digest"], e["bytes"], e["replicas"])
            for e in _events(client, run_id, "weights_synced")]


def test_broadcast_source_matches_the_grpc_source_bitwise(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=2)
    with LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[model.parent]) as stack:
        client = stack.client(timeout_s=60)
        outcomes = {}
        for source in ("grpc", "broadcast"):
            run = client.submit(_spec(model, f"sync-{source}", source))
            done = client.wait(run["id"], timeout_s=600)
            assert done["status"] == "completed", done
            outcomes[source] = (run["id"], [s["metrics"] for s in client.metrics(run["id"])["steps"]],
                                _synced(client, run["id"]))
        (_, grpc_metrics, grpc_synced), (broadcast_id, broadcast_metrics, broadcast_synced) = outcomes.values()
        assert len(broadcast_metrics) == 3 and broadcast_metrics == grpc_metrics
        # Both replicas received versions 1 to 3 in one group each sync, and report the digest the gRPC
        # stream carries for them (sha256 over every tensor's bytes in the trainer's order).
        replicas = sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
        assert [s[0] for s in broadcast_synced] == [1, 2, 3] and all(s[3] == replicas for s in broadcast_synced)
        assert broadcast_synced == grpc_synced
        assert not _events(client, broadcast_id, "weights_caught_up")
        trainer_log = (stack.run_dir / "logs" / "trainer.log").read_text()
        assert trainer_log.count('"weights broadcast"') == 3 and '"world_size": 3' in trainer_log

        channel = sync_channel(f"127.0.0.1:{stack.rollout_ports[0]}", stack.token)
        try:
            rollout = pb_grpc.RolloutStub(channel)
            plan = pb.BroadcastPlan(
                run_id=broadcast_id, policy_version=4, group_name="g", rendezvous=f"127.0.0.1:{stack.broadcast_port}",
                backend="gloo", world_size=2, digest_trailer=True, tensors=1, bytes=4,
                buckets=[pb.BroadcastBucket(tensors=[pb.BroadcastTensor(name="x", dtype="float32", shape=[1])],
                                            nbytes=4)])

            def receive(plan: pb.BroadcastPlan, rank: int = 1) -> grpc.RpcError:
                with pytest.raises(grpc.RpcError) as refused:
                    rollout.ReceiveWeights(pb.ReceiveWeightsRequest(plan=plan, rank=rank), timeout=60)
                return refused.value

            elsewhere = pb.BroadcastPlan()
            elsewhere.CopyFrom(plan)
            elsewhere.rendezvous = "10.0.0.1:29500"
            outside = receive(elsewhere)
            assert outside.code() == grpc.StatusCode.PERMISSION_DENIED and "broadcast_sources" in outside.details()
            unverified = pb.BroadcastPlan()
            unverified.CopyFrom(plan)
            unverified.digest_trailer = False
            refused = receive(unverified)
            assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "digest_trailer" in refused.details()
            assert receive(plan, rank=2).code() == grpc.StatusCode.INVALID_ARGUMENT
            assert rollout.Info(pb.InfoRequest(), timeout=10).policy_version == 3
        finally:
            channel.close()
