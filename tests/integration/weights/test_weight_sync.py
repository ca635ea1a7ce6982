"""Weights go trainer -> rollout directly: a > 1 GB policy synced to two replicas through the real stack,
by the gRPC source and by the broadcast source (gloo on CPU).

The coordinator only tells each replica which version to pull from which trainer (SyncWeights), or asks
the trainer to broadcast it to a group of the replicas; the weights never pass through the coordinator.
Checked here with real processes: the coordinator's peak RSS stays flat while two replicas each receive
the whole model, both replicas report the digest the trainer computes over what it serves, and a replica
refuses a trainer it was not configured to trust. Both runs share one stack and one model: building and
loading a gigabyte policy is most of what these tests cost.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.common.grpc.options import sync_channel
from services.local_stack import LocalStack
from tests.support.digest_reference import digest_of_byte_strings

pytestmark = pytest.mark.slow

# 5 layers of a 2048-wide SwiGLU block: 315M parameters, 1.26 GB as float32 (the runs' dtype: on a CPU without
# bf16 matrix units a float32 step is several times faster than a bfloat16 one).
LARGE = TinyQwen3Config(hidden_size=2048, num_hidden_layers=5, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=8192, max_position_embeddings=64)
MAX_RSS_GROWTH_BYTES = 100 * 1024 * 1024


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def _served_digest(stack: LocalStack, run_id: str) -> tuple[int, str, int]:
    """(policy_version, digest, bytes) of what the trainer serves now; the digest recomputed here from its
    definition: sha256 over the sha256 of every tensor's 4 MiB blocks, in stream order."""
    channel = sync_channel(f"127.0.0.1:{stack.trainer_port}", stack.token)
    try:
        tensors: dict[str, bytearray] = {}
        nbytes, last = 0, None
        for chunk in pb_grpc.TrainerStub(channel).GetWeights(pb.GetWeightsRequest(run_id=run_id), timeout=300):
            tensors.setdefault(chunk.name, bytearray()).extend(chunk.data)
            nbytes += len(chunk.data)
            last = chunk
        assert last is not None and last.total_sha256 == digest_of_byte_strings([bytes(d) for d in tensors.values()])
        return last.policy_version, last.total_sha256, nbytes
    finally:
        channel.close()


@pytest.fixture(scope="module")
def large_model(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("large") / "model", LARGE, seed=0)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, large_model):
    """Its own stack, not the session's shared one: a trainer and two replicas that have served a gigabyte
    policy hold several GB, which the rest of the session should not keep."""
    with LocalStack(tmp_path_factory.mktemp("large-stack"), rollout_replicas=2,
                    path_roots=[large_model.parent]) as s:
        yield s


def _large_run(stack: LocalStack, large_model: Path, name: str, weight_sync: str) -> tuple[dict, list[dict], int]:
    """A one-step float32 run of the large policy: (run, its weights_synced events, how much the
    coordinator's peak RSS grew while it ran)."""
    client = stack.client(timeout_s=120)
    try:
        coordinator_pid = stack.coordinator.proc.pid
        before = _peak_rss_bytes(coordinator_pid)
        run = client.submit({
            "name": name, "model_path": str(large_model), "seed": 1, "steps": 1,
            "task": {"name": "arithmetic", "options": {"digits": 1, "heldout_size": 2}},
            "rollout": {"engine_options": {"dtype": "float32"}, "prompts_per_step": 2, "samples_per_prompt": 2,
                        "sampling": {"temperature": 1.0, "max_new_tokens": 2}, "weight_sync": weight_sync},
            "trainer": {"lr": 1e-4, "temperature": 1.0, "dtype": "float32",
                        "parity_gate": {"logprob_abs_diff_mean": 1.0, "iw_mean_tolerance": 1.0, "iw_max": 1e6}},
            "eval": {"every": 0, "heldout_size": 2}, "checkpoint": {"final": False},
        })
        done = client.wait(run["id"], timeout_s=900)
        assert done["status"] == "completed", done
        # checkpoint.final false: the 3.8 GB of weights and AdamW state a last checkpoint would write (and take
        # longer to write than the run takes) are not written, nor recorded.
        assert not (stack.run_dir / "coordinator" / run["id"] / "checkpoints").exists()
        assert "checkpoint" not in client.metrics(run["id"])["steps"][0]["timings"], done
        growth = _peak_rss_bytes(coordinator_pid) - before
        synced = [e for e in client.run(run["id"])["events"] if e["event"] == "weights_synced"]
        return run, synced, growth
    finally:
        client.close()


def test_a_gigabyte_policy_reaches_two_replicas_without_passing_the_coordinator(stack, large_model):
    run, synced, growth = _large_run(stack, large_model, "large-sync", "grpc")
    version, digest, nbytes = _served_digest(stack, run["id"])
    assert nbytes > 1_000_000_000
    # Both replicas pulled version 1 and verified it against the trainer's own digest of it.
    assert [(e["policy_version"], e["digest"], e["bytes"]) for e in synced] == [(1, digest, nbytes)], synced
    assert version == 1
    assert synced[0]["replicas"] == sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
    # Relaying the stream would have held at least one whole copy of it in the coordinator.
    assert growth < MAX_RSS_GROWTH_BYTES, f"coordinator peak RSS grew by {growth / 2**20:.0f} MiB"

    # The replica trusts only its configured trainer: any other address is refused before a byte moves.
    channel = sync_channel(f"127.0.0.1:{stack.rollout_ports[0]}", stack.token)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.RolloutStub(channel).SyncWeights(pb.SyncWeightsRequest(
                run_id=run["id"], policy_version=1, trainer_address="127.0.0.1:1"), timeout=30)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "weight_sources" in refused.value.details()
        # And a version the trainer does not serve is refused, not applied.
        with pytest.raises(grpc.RpcError) as stale:
            pb_grpc.RolloutStub(channel).SyncWeights(pb.SyncWeightsRequest(
                run_id=run["id"], policy_version=7, trainer_address=f"127.0.0.1:{stack.trainer_port}"), timeout=300)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds version 1" in stale.value.details() and "no copy of version 7" in stale.value.details()
    finally:
        channel.close()


def test_a_gigabyte_policy_is_broadcast_to_two_replicas_without_passing_the_coordinator(stack, large_model):
    run, synced, growth = _large_run(stack, large_model, "large-broadcast", "broadcast")
    version, digest, nbytes = _served_digest(stack, run["id"])
    assert nbytes > 1_000_000_000
    # Both replicas received version 1 in one group and verified the trainer's digest of it.
    assert [(e["policy_version"], e["digest"], e["bytes"]) for e in synced] == [(1, digest, nbytes)], synced
    assert version == 1 and synced[0]["replicas"] == sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
    assert growth < MAX_RSS_GROWTH_BYTES, f"coordinator peak RSS grew by {growth / 2**20:.0f} MiB"
