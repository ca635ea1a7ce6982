"""The broadcast weight source (rollout.weight_sync: broadcast) through the real stack, over gloo on CPU.

Each sync, the trainer (rank 0) and both torch replicas (ranks 1 and 2) form one torch.distributed group
at the trainer's configured rendezvous; the trainer broadcasts the policy in buckets and then their
digest, each replica checks that digest against its own over what arrived before applying. Checked with
real processes: a run completes with metrics bitwise those of the gRPC source, both replicas report the
digests the gRPC stream carries for the same versions -- with an intruder hammering the trainer's
rendezvous, which listens on its configured 127.0.0.1 only, throughout the broadcast run -- and a replica
refuses a rendezvous it was not configured to trust and a plan it cannot verify, without changing the
weights it serves. A LoRA run's
adapters go alone, as over the stream; a replica restarted mid-run is brought to the run's version in a
group of its own (weights_caught_up) and rejoins the next syncs (a 1.1 GB policy broadcast with the
coordinator's peak RSS flat is in test_weight_sync.py, beside the gRPC source's). A round that cannot
complete ends at once rather than after the broadcast timeout (600 s in those tests): replicas that refuse
the trainer's rendezvous fail the run naming their refusal, and a replica lost during a sync is evicted and
the others synced again without it.
"""
from __future__ import annotations

import json
import time

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.grpc.options import sync_channel
from services.common.process.ports import free_port
from services.local_stack import LocalStack
from tests.support.rendezvous import Intruder, listening_ips
from tests.support.stack_logs import text_after
from tests.support.weight_sync_runs import run_events, sync_spec, synced

pytestmark = pytest.mark.slow


def test_broadcast_source_matches_the_grpc_source_bitwise(tmp_path, two_replica_stack):
    model = build_model_dir(tmp_path / "model", seed=2)
    stack = two_replica_stack  # shared (tests/integration/conftest.py): these runs change nothing in it
    trainer_log_path = stack.run_dir / "logs" / "trainer.log"
    trainer_log_offset = trainer_log_path.stat().st_size
    client = stack.client(timeout_s=60)
    rendezvous = f"127.0.0.1:{stack.broadcast_port}"
    assert listening_ips(stack.trainer.proc.pid, stack.broadcast_port) == ["127.0.0.1"]
    outcomes = {}
    for source in ("grpc", "broadcast"):
        # Without the token it cannot learn the groups' names; it tries a name's every key anyway.
        intruder = Intruder(rendezvous, ["lockstep-weights-000000000000"])
        if source == "broadcast":
            intruder.start()
        try:
            run = client.submit(sync_spec(model, f"sync-{source}", source))
            done = client.wait(run["id"], timeout_s=600)
        finally:
            intruder.stop()
        assert done["status"] == "completed", done
        assert intruder.accepted == [] and (intruder.attempts > 0) == (source == "broadcast")
        outcomes[source] = (run["id"], [s["metrics"] for s in client.metrics(run["id"])["steps"]],
                            synced(client, run["id"]))
    (_, grpc_metrics, grpc_synced), (broadcast_id, broadcast_metrics, broadcast_synced) = outcomes.values()
    assert len(broadcast_metrics) == 3 and broadcast_metrics == grpc_metrics
    # Both replicas received versions 1 to 3 in one group each sync, and report the digest the gRPC
    # stream carries for them (sha256 over every tensor's bytes in the trainer's order).
    replicas = sorted(f"127.0.0.1:{p}" for p in stack.rollout_ports)
    assert [s[0] for s in broadcast_synced] == [1, 2, 3] and all(s[3] == replicas for s in broadcast_synced)
    assert broadcast_synced == grpc_synced
    assert not run_events(client, broadcast_id, "weights_caught_up")
    trainer_log = text_after(trainer_log_path, trainer_log_offset)
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


def test_a_lora_runs_adapters_go_over_the_broadcast_alone_as_over_the_stream(tmp_path, two_replica_stack):
    model = build_model_dir(tmp_path / "model", seed=4)
    stack = two_replica_stack  # shared (tests/integration/conftest.py): these runs change nothing in it
    rollout_log_path = stack.run_dir / "logs" / "rollout1.log"
    rollout_log_offset = rollout_log_path.stat().st_size
    client = stack.client(timeout_s=60)
    outcomes = {}
    for source in ("grpc", "broadcast"):
        spec = sync_spec(model, f"lora-{source}", source)
        spec["trainer"] = {"lr": 1e-2, "lora": {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}}
        run = client.submit(spec)
        done = client.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        outcomes[source] = ([s["metrics"] for s in client.metrics(run["id"])["steps"]], synced(client, run["id"]))
    assert outcomes["broadcast"] == outcomes["grpc"] and len(outcomes["grpc"][0]) == 3
    log = text_after(rollout_log_path, rollout_log_offset).splitlines()
    received = [json.loads(line) for line in log if '"ReceiveWeights"' in line and '"weights updated"' in line]
    # 2 layers x 7 linear layers x (A, B): the adapters alone, marked as such, for versions 1 to 3.
    assert [(u["policy_version"], u["lora"], u["tensors"]) for u in received] == [(v, True, 28) for v in (1, 2, 3)]
    assert all(u["bytes"] == outcomes["grpc"][1][0][2] for u in received)


def test_a_replica_restarted_mid_run_is_caught_up_in_a_group_of_its_own(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    # A rank that died before joining is waited for this long (not the default 300 s) before the group fails.
    env = {"LOCKSTEP_TRAINER_WEIGHT_BROADCAST_TIMEOUT_S": "20", "LOCKSTEP_ROLLOUT_WEIGHT_BROADCAST_TIMEOUT_S": "20"}
    with LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[tmp_path], extra_env=env) as stack:
        client = stack.client(timeout_s=120)
        spec = sync_spec(model, "catch-up", "broadcast")
        spec["steps"] = 10_000  # runs until the replica is back in the syncs, then is cancelled
        run = client.submit(spec)
        address = f"127.0.0.1:{stack.rollout_ports[1]}"

        def events_until(done, what: str) -> list[dict]:
            deadline = time.monotonic() + 600
            while not done(events := client.run(run["id"])["events"]):
                assert client.run(run["id"])["status"] in ("pending", "running") and time.monotonic() < deadline, \
                    (what, events)
                time.sleep(0.2)
            return events

        events_until(lambda ev: sum(e["event"] == "weights_synced" for e in ev) >= 2, "two syncs")
        victim = stack.rollouts[1]
        victim.kill()  # its model and weights are gone
        time.sleep(3.0)
        victim.start()  # same port, no model loaded
        events = events_until(lambda ev: any(e["event"] == "weights_caught_up" for e in ev) and any(
            e["event"] == "weights_synced" and address in e["replicas"]
            and e["policy_version"] > max(c["policy_version"] for c in ev if c["event"] == "weights_caught_up")
            for e in ev), "the replica caught up and synced again")
        client.cancel(run["id"])

        evicted = [e for e in events if e["event"] == "replica_evicted"]
        caught_up = [e for e in events if e["event"] == "weights_caught_up"]
        readmitted = [e for e in events if e["event"] == "replica_readmitted"]
        assert [e["replica"] for e in evicted] == [address] and [e["replica"] for e in caught_up] == [address]
        assert [e["replica"] for e in readmitted] == [address]
        # It received the version the run was at, and verified the digest every replica reported for it.
        sent = {e["policy_version"]: e["digest"] for e in events if e["event"] == "weights_synced"}
        assert caught_up[0]["digest"] == sent[caught_up[0]["policy_version"]]
        assert caught_up[0]["policy_version"] == readmitted[0]["policy_version"]
        names = [e["event"] for e in events]
        assert names.index("replica_evicted") < names.index("weights_caught_up") < names.index("replica_readmitted")


# Both sides wait this long for a group's ranks: far beyond how long any test below may take.
LONG_TIMEOUTS = {"LOCKSTEP_TRAINER_WEIGHT_BROADCAST_TIMEOUT_S": "600",
                 "LOCKSTEP_ROLLOUT_WEIGHT_BROADCAST_TIMEOUT_S": "600"}
# A round the coordinator aborts is over within this long (on a loaded machine); waiting out the
# timeouts above would take 600 s.
PROMPT_S = 120


def test_replicas_that_refuse_the_trainers_rendezvous_fail_the_run_at_once(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=2)
    stack = LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[model.parent], extra_env=LONG_TIMEOUTS)
    for rollout in stack.rollouts:  # trusting some other rendezvous, not this trainer's
        rollout.args[rollout.args.index("--broadcast-sources") + 1] = f"127.0.0.1:{free_port()}"
    with stack:
        client = stack.client(timeout_s=60)
        run = client.submit(sync_spec(model, "refused", "broadcast"))
        done = client.wait(run["id"], timeout_s=900)
        assert done["status"] == "failed", done
        configured = run_events(client, run["id"], "services_configured")[0]["ts"]
        assert done["updated_at"] - configured < PROMPT_S, done
        # The trainer gave up on version 1's group naming the ranks and why; the run's error carries the
        # replicas' refusals.
        assert "weight broadcast" in done["error"] and "never joined: aborted: ReceiveWeights failed" in done["error"]
        assert done["error"].count("PERMISSION_DENIED: plan.rendezvous") >= 2, done["error"]
        assert not run_events(client, run["id"], "weights_synced") and not run_events(client, run["id"], "replica_evicted")


def test_a_replica_lost_during_a_sync_is_evicted_and_the_rest_regrouped_at_once(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    stack = LocalStack(tmp_path / "stack", rollout_replicas=2, path_roots=[model.parent], extra_env=LONG_TIMEOUTS)
    victim = stack.rollouts[1]
    # It answers Info before the sync of version 2, then its process dies as its ReceiveWeights begins.
    victim.args = [victim.args[0], "-m", "tests.support.crashing_rollout", "--crash-on-receive-weights", "2",
                   *victim.args[3:]]
    with stack:
        client = stack.client(timeout_s=60)
        run = client.submit(sync_spec(model, "lost", "broadcast"))
        done = client.wait(run["id"], timeout_s=900)
        assert done["status"] == "completed", done
        assert victim.proc.wait(timeout=30) == 137
        lost, kept = (f"127.0.0.1:{p}" for p in (stack.rollout_ports[1], stack.rollout_ports[0]))
        evicted = run_events(client, run["id"], "replica_evicted")
        assert [(e["replica"], e["reason"]) for e in evicted] == [(lost, "weight broadcast failed "
                                                                         "(StatusCode.UNAVAILABLE)")]
        regrouped = run_events(client, run["id"], "weight_broadcast_regrouped")
        assert [(e["policy_version"], e["dropped"], e["replicas"]) for e in regrouped] == [(2, [lost], [kept])]
        assert [(s[0], s[3]) for s in synced(client, run["id"])] == [(1, sorted([lost, kept])), (2, [kept]),
                                                                       (3, [kept])]
        sync_seconds = [s["timings"]["weight_sync"] for s in client.metrics(run["id"])["steps"]]
        assert sync_seconds[1] < PROMPT_S, sync_seconds

