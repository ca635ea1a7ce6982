"""The shared-path weight source (rollout.weight_sync: shared_path) through the real stack.

The trainer writes each policy version once as safetensors under the run's directory (WriteWeights), each
replica reads it and verifies the trainer's digest (LoadWeights). Checked with real processes: a run
completes with metrics bitwise those of the gRPC source, both replicas report the same digests as under
the gRPC source, and a replica refuses a directory outside its model_roots, a wrong digest and a wrong
version without changing the weights it serves. A directory it prefetched is applied from what it read then.
"""
from __future__ import annotations

import shutil

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.grpc.options import sync_channel
from tests.support.weight_sync_runs import sync_spec, synced

pytestmark = pytest.mark.slow


def test_shared_path_source_matches_the_grpc_source_bitwise(two_replica_stack, tmp_path):
    model = build_model_dir(tmp_path / "model", seed=2)
    stack = two_replica_stack  # shared (tests/integration/conftest.py): these runs change nothing in it
    client = stack.client(timeout_s=60)
    outcomes = {}
    for source in ("grpc", "shared_path"):
        run = client.submit(sync_spec(model, f"sync-{source}", source))
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        outcomes[source] = (run["id"], [s["metrics"] for s in client.metrics(run["id"])["steps"]],
                            synced(client, run["id"]))
    (_, grpc_metrics, grpc_synced), (shared_id, shared_metrics, shared_synced) = outcomes.values()
    assert len(shared_metrics) == 3 and shared_metrics == grpc_metrics
    # Both replicas loaded versions 1 to 3 and report the digest the gRPC stream carries for them.
    replicas = sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
    assert [s[0] for s in shared_synced] == [1, 2, 3] and all(s[3] == replicas for s in shared_synced)
    assert shared_synced == grpc_synced
    # Each version was written once, as a complete model directory; the newest two are kept.
    written = sorted((stack.run_dir / "coordinator" / shared_id / "weights").glob("v*"))
    assert [p.name[:7] for p in written] == ["v000002", "v000003"], written
    assert sorted(p.name for p in written[-1].iterdir()) == sorted(
        p.name for p in model.iterdir())

    channel = sync_channel(f"127.0.0.1:{stack.rollout_ports[0]}", stack.token)
    try:
        rollout = pb_grpc.RolloutStub(channel)
        version, digest = shared_synced[-1][0], shared_synced[-1][1]

        def load(**overrides) -> grpc.RpcError:
            request = {"run_id": shared_id, "policy_version": version, "directory": str(written[-1]),
                       "expected_sha256": digest, **overrides}
            with pytest.raises(grpc.RpcError) as refused:
                rollout.LoadWeights(pb.LoadWeightsRequest(**request), timeout=60)
            return refused.value

        outside = load(directory="/etc")
        assert outside.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside the allowed roots" in outside.details()
        wrong = load(expected_sha256="0" * 64)
        assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"hash to {digest}, not {'0' * 64}" in wrong.details()
        stale = load(policy_version=7)
        assert stale.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "holds version 3, not 7" in stale.details()
        assert rollout.Info(pb.InfoRequest(), timeout=10).policy_version == version
        # The intact request is accepted (the loaded version again, identical weights: a no-op).
        again = rollout.LoadWeights(pb.LoadWeightsRequest(run_id=shared_id, policy_version=version,
                                                          directory=str(written[-1]), expected_sha256=digest),
                                    timeout=60)
        assert again.total_sha256 == digest and again.policy_version == version and not again.prefetched

        # Prefetch: a copy of the directory is read and verified, nothing applied; removed afterwards, the
        # load that names it still applies it (from what the prefetch kept: there is nothing left to read).
        copy = written[-1].parent / "prefetched-copy"
        shutil.copytree(written[-1], copy)
        request = {"run_id": shared_id, "policy_version": version, "directory": str(copy), "expected_sha256": digest}
        wrong = load(directory=str(copy), expected_sha256="1" * 64, prefetch=True)
        assert wrong.code() == grpc.StatusCode.INVALID_ARGUMENT and f"hash to {digest}" in wrong.details()
        read = rollout.LoadWeights(pb.LoadWeightsRequest(**request, prefetch=True), timeout=60)
        assert (read.policy_version, read.total_sha256, read.prefetched) == (version, digest, False)
        shutil.rmtree(copy)
        applied = rollout.LoadWeights(pb.LoadWeightsRequest(**request), timeout=60)
        assert (applied.policy_version, applied.total_sha256, applied.prefetched) == (version, digest, True)
        gone = load(directory=str(copy))  # taken once: the next load reads, and the directory is gone
        assert gone.code() == grpc.StatusCode.INVALID_ARGUMENT and "no model.safetensors" in gone.details()
        assert rollout.Info(pb.InfoRequest(), timeout=10).policy_version == version
    finally:
        channel.close()
