"""The IPC weight source (rollout.weight_sync: ipc / auto) through the real stack, on CPU.

Trainer and both torch replicas run on this machine, so the coordinator finds them on one node and hands
each version over in place: the trainer packs it into shared-memory buckets (the CPU transport of the same
protocol the CUDA path uses), each replica fetches the handles from the trainer itself, maps them, verifies
the digest with the trainer, applies and releases them. Checked with real processes: a run completes with
metrics bitwise those of the gRPC source and the digests the gRPC stream carries for the same versions, the
choice is recorded with its reason, and a MapWeights naming no open handover, a trainer outside the
replica's weight_sources, or a stale version applies nothing.
"""
from __future__ import annotations

import json

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.grpc.options import sync_channel
from tests.support.stack_logs import text_after
from tests.support.weight_sync_runs import run_events, sync_spec, synced

pytestmark = pytest.mark.slow


def test_ipc_source_matches_the_grpc_source_bitwise(tmp_path, two_replica_stack):
    model = build_model_dir(tmp_path / "model", seed=2)
    stack = two_replica_stack  # shared (tests/integration/conftest.py): these runs change nothing in it
    trainer_log_path = stack.run_dir / "logs" / "trainer.log"
    trainer_log_offset = trainer_log_path.stat().st_size
    client = stack.client(timeout_s=60)
    outcomes = {}
    for source in ("grpc", "ipc", "auto"):
        run = client.submit(sync_spec(model, f"sync-{source}", source))
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", str(done)
        outcomes[source] = (run["id"], [s["metrics"] for s in client.metrics(run["id"])["steps"]],
                            synced(client, run["id"]))
    grpc_id, grpc_metrics, grpc_synced = outcomes["grpc"]
    replicas = sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
    for source in ("ipc", "auto"):
        run_id, metrics, got = outcomes[source]
        assert len(metrics) == 3 and metrics == grpc_metrics
        assert [s[0] for s in got] == [1, 2, 3] and all(s[3] == replicas for s in got)
        assert got == grpc_synced  # the same digests (and bytes) the gRPC stream carries
        chosen = run_events(client, run_id, "weight_source_chosen")
        assert [(e["source"], e["configured"]) for e in chosen] == [("ipc", source)], chosen
        assert "every replica on node" in chosen[0]["reason"]
        assert {e["source"] for e in run_events(client, run_id, "weights_synced")} == {"ipc"}
    assert {e["source"] for e in run_events(client, grpc_id, "weights_synced")} == {"grpc"}
    assert not run_events(client, grpc_id, "weight_source_chosen")
    trainer_log = text_after(trainer_log_path, trainer_log_offset)
    # Versions 1-3 of two runs, one handover each for both replicas, every one closed with no share left over.
    assert trainer_log.count('"weight handover opened"') == 6 and '"backend": "cpu_shm"' in trainer_log
    assert trainer_log.count('"weight handover closed"') == 6 and '"unreleased": 1' not in trainer_log
    # Each side logs how long each step of a handover took (what bench/weight_sync_ipc.py reports).
    hashed = [json.loads(line) for line in trainer_log.splitlines() if '"weight handover hashed"' in line]
    assert len(hashed) == 6 and all(e["phases_ms"]["digest"] >= 0 for e in hashed), hashed
    mapped = [json.loads(line) for i in range(2)
              for line in (stack.run_dir / "logs" / f"rollout{i}.log").read_text().splitlines()
              if '"weight handover mapped"' in line and '"' + outcomes["auto"][0] + '"' in line]
    phases = ["handles", "map", "digest", "verify", "finite", "apply", "unmap", "release"]
    assert len(mapped) == 6 and all(list(e["phases_ms"]) == phases for e in mapped), mapped

    ipc_run = outcomes["auto"][0]  # the run the replicas hold now
    channel = sync_channel(f"127.0.0.1:{stack.rollout_ports[0]}", stack.token)
    try:
        rollout = pb_grpc.RolloutStub(channel)

        def refused(**fields) -> grpc.RpcError:
            request = pb.MapWeightsRequest(run_id=ipc_run, policy_version=4, handover_id="0" * 32,
                                           trainer_address=f"127.0.0.1:{stack.trainer_port}")
            for name, value in fields.items():
                setattr(request, name, value)
            with pytest.raises(grpc.RpcError) as caught:
                rollout.MapWeights(request, timeout=60)
            return caught.value

        elsewhere = refused(trainer_address="10.0.0.1:50051")
        assert elsewhere.code() == grpc.StatusCode.PERMISSION_DENIED and "weight_sources" in elsewhere.details()
        # No handover of that id is open: the trainer refuses to hand anything out, and the replica says why.
        foreign = refused()
        assert foreign.code() == grpc.StatusCode.FAILED_PRECONDITION and "GetWeightHandles" in foreign.details()
        assert "handover_id: no open weight handover" in foreign.details()
        other_run = refused(run_id="another-run")
        assert other_run.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert rollout.Info(pb.InfoRequest(), timeout=10).policy_version == 3
        details = rollout.Info(pb.InfoRequest(), timeout=10).details
        assert details["node_id"] and details["hostname"]
    finally:
        channel.close()


def test_a_fixed_lag_run_over_ipc_syncs_in_the_steps_path_and_trains_as_over_grpc(tmp_path, two_replica_stack):
    """The handover packs the live weights under the trainer's lock, so an async run syncs its replicas to s-1
    before step s trains rather than beside it; the versions each step trains on, and so its metrics, are the
    gRPC run's."""
    model = build_model_dir(tmp_path / "model", seed=3)
    client = two_replica_stack.client(timeout_s=60)
    metrics = {}
    for source in ("grpc", "ipc"):
        spec = sync_spec(model, f"lag-{source}", source)
        spec["async"] = {"max_staleness": 1, "mode": "fixed_lag"}
        spec["trainer"] = {"mismatch_correction": {"mode": "truncate", "upper": 2.0}}
        run = client.submit(spec)
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", str(done)
        metrics[source] = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    assert [m["weight_sync_beside_training"] for m in metrics["ipc"]] == [0, 0, 0]
    assert [m["weight_sync_beside_training"] for m in metrics["grpc"]][1:] == [1, 1]

    def without(ms):
        return [{k: v for k, v in m.items() if k != "weight_sync_beside_training"} for m in ms]
    assert len(metrics["ipc"]) == 3 and without(metrics["ipc"]) == without(metrics["grpc"])
