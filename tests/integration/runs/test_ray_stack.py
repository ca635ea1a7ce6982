"""The stack on a real two-node Ray cluster (two raylets on this machine), the trainer as FSDP ranks placed
across both: four ranks two per raylet, and two ranks one per raylet, train three fixed steps like one
rank; the two-rank stack serves a run through REST, survives a SIGKILLed rank (the group fails closed,
is restarted, and the run resumes from its last checkpoint with no step lost or trained twice), serves
runs whose weights rank 0 streams (gRPC), writes (shared path) and broadcasts (gloo on CPU, at the
rendezvous on its node), every replica reporting the digest the trainer serves, and is gone after
SIGTERM. `python -m services.ray_stack` as a real process, the services as real processes in
Ray actors. One cluster for every test here."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.cli.client import CoordinatorClient
from services.common.auth import read_token_file
from services.common.grpc.options import sync_channel
from services.common.process.ports import free_port_run
from services.ray_stack.config import RayStackConfig
from services.ray_stack.launcher import RayStack
from services.trainer.distributed.worker_group import WORKER_LOST_EXIT
from tests.conftest import require
from tests.support.trainer_steps import assert_like_one_rank, grpc_metrics, one_rank_metrics, step_chunks
from tests.support.weight_sync_runs import sync_spec
from tests.trainer.trainer_support import build_tiny_model_dir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


@pytest.fixture(scope="module")
def cluster():
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError:
        require(False, "ray is not installed (pip install 'ray==2.60.0')")
    # Ray starts its workers at nice 15 (worker_niceness) and every service process inherits that from its actor.
    # The suite runs the stack tests at nice 0 beside the learning runs at nice 5 and the unit tests at nice 10
    # (tests/run_suite.sh): at 15 the services here got the cores after all of them, and a ConfigureRun of four
    # ranks took over 120 s in CI. At 0 they run at this process's niceness, as the other stack tests' services do.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                      "_system_config": {"worker_niceness": 0}})
    c.add_node(num_cpus=2)
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """A tiny model, three fixed TrainStep streams, and what one rank makes of them."""
    model = build_tiny_model_dir(tmp_path_factory.mktemp("ranks_model"))
    streams = step_chunks(model)
    return model, streams, one_rank_metrics(model, streams)


def test_four_trainer_ranks_two_per_raylet_train_like_one_rank(cluster, steps, tmp_path):
    model, streams, one = steps
    port = free_port_run(2, "")
    # Two CPUs per raylet and one per rank: PACK fills one node with two ranks, then the other.
    config = RayStackConfig(ray_address=cluster.address, namespace="lockstep-ranks", trainer_world_size=4,
                            trainer_placement_strategy="PACK", trainer_rendezvous_port=port, trainer_port=port + 1,
                            trainer_metrics_port=0, data_dir=str(tmp_path / "data"), path_roots=[str(model)],
                            ready_timeout_s=240)
    stack = RayStack(config)
    try:
        placed = stack.place_trainer()
        assert set(placed) == {"trainer", "trainer-rank-1", "trainer-rank-2", "trainer-rank-3"}
        assert sorted(Counter(p["node_id"] for p in placed.values()).values()) == [2, 2], placed
        got = grpc_metrics(placed["trainer"]["address"], read_token_file(config.token_path()), model, streams)
        assert all(s["restarts"] == 0 for s in stack.describe().values())
    finally:
        stack.close()
    assert_like_one_rank(got, one)


def _served_weights(trainer_address: str, token, run_id: str) -> tuple[int, str]:
    """(policy_version, digest) of what the trainer serves now, as its gRPC stream carries them."""
    channel = sync_channel(trainer_address, token)
    try:
        *_, last = pb_grpc.TrainerStub(channel).GetWeights(pb.GetWeightsRequest(run_id=run_id), timeout=120)
        return last.policy_version, last.total_sha256
    finally:
        channel.close()


def test_stack_with_two_trainer_ranks_on_two_ray_nodes_survives_a_killed_rank_and_stops_cleanly(
        cluster, steps, tmp_path):
    tiny, streams, one = steps
    model = build_model_dir(tmp_path / "model", seed=3)
    ports = free_port_run(9, "")  # every interface: the services bind the node address
    cmd = [sys.executable, "-m", "services.ray_stack", "--ray-address", cluster.address,
           "--trainer-world-size", "2", "--trainer-placement-strategy", "STRICT_SPREAD",
           "--trainer-rendezvous-port", str(ports + 8),
           "--rollout-replicas", "2", "--placement-strategy", "SPREAD", "--data-dir", str(tmp_path / "data"),
           "--path-roots", f"{model},{tiny}",
           "--coordinator-port", str(ports), "--trainer-port", str(ports + 1),
           "--trainer-metrics-port", str(ports + 2), "--rollout-port-base", str(ports + 3),
           "--rollout-metrics-port-base", str(ports + 5), "--trainer-broadcast-port", str(ports + 7),
           "--restart-delay-s", "0.5", "--ready-timeout-s", "240"]
    launcher = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / "launcher.log", "wb"),
                                text=True)
    try:
        line = launcher.stdout.readline()
        assert line, f"launcher exited with {launcher.wait()}:\n{(tmp_path / 'launcher.log').read_text()[-4000:]}"
        ready = json.loads(line)
        services = ready["services"]
        assert set(services) == {"trainer", "trainer-rank-1", "rollout-0", "rollout-1", "coordinator"}
        # STRICT_SPREAD: one rank per raylet; the rollouts take the CPU left on each.
        assert services["trainer"]["node_id"] != services["trainer-rank-1"]["node_id"], services
        assert services["rollout-0"]["node_id"] != services["rollout-1"]["node_id"], services
        assert ready["rollouts"] == [services["rollout-0"]["address"], services["rollout-1"]["address"]]
        assert all(s["alive"] and s["restarts"] == 0 for s in services.values()), services
        # The rendezvous is on the trainer's node, at the configured port.
        trainer_host = services["trainer"]["address"].rsplit(":", 1)[0]
        assert ready["weight_broadcast_address"] == services["trainer"]["weight_broadcast_address"] \
            == f"{trainer_host}:{ports + 7}"

        assert ready["token_file"] == str(tmp_path / "data" / "auth_token")
        token = read_token_file(ready["token_file"])
        assert_like_one_rank(grpc_metrics(ready["trainer"], token, tiny, streams), one)
        client = CoordinatorClient(ready["api_url"], token=token)
        try:
            run = client.submit({
                "name": "on-ray", "model_path": str(model), "seed": 5, "steps": 6,
                "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
                "rollout": {"prompts_per_step": 4, "samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}},
                "eval": {"every": 0, "heldout_size": 8}, "checkpoint": {"every": 2},
            })
            deadline = time.monotonic() + 300
            # One read of the run per poll: its step and its status as of that read.
            while (now := client.run(run["id"]))["step"] < 2:
                assert now["status"] in ("pending", "running"), now
                assert time.monotonic() < deadline, "run did not reach step 2"
                time.sleep(0.05)
            # Rank 1 dies: rank 0 exits with it (the group fails closed), both supervisors restart their
            # rank, the ranks meet again at rank 0's store, and the coordinator resumes the run.
            os.kill(services["trainer-rank-1"]["pid"], signal.SIGKILL)
            done = client.wait(run["id"], timeout_s=300)
            assert done["status"] == "completed", done
            events = client.run(run["id"])["events"]
            assert [e["event"] for e in events].count("trainer_lost") == 1, events
            recovered = [e for e in events if e["event"] == "trainer_recovered"]
            assert len(recovered) == 1, events
            # From the checkpoint the trainer wrote on the shared storage the stack names (data_dir).
            resumed = Path(recovered[0]["resumed_from"])
            assert resumed.is_relative_to(tmp_path / "data") and resumed.name.startswith("step_"), recovered
            # Every step recorded once, in order: none lost, none trained twice. A recorded step after the
            # checkpoint is computed again by the restarted group, bit for bit (checked, never re-recorded).
            assert [s["step"] for s in client.metrics(run["id"])["steps"]] == list(range(1, 7))
            recomputed = [e for e in events if e["event"] == "step_recomputed"]
            assert all(e["matches_recorded"] for e in recomputed), recomputed
            # The gRPC source from the two-rank trainer: rank 0 streams the gathered weights; both replicas
            # report the digest the trainer serves for the last version.
            synced = [e for e in events if e["event"] == "weights_synced"]
            assert synced[-1]["policy_version"] == 6 and synced[-1]["replicas"] == sorted(ready["rollouts"]), synced
            assert _served_weights(ready["trainer"], token, run["id"]) == (6, synced[-1]["digest"])

            # The shared-path source (rank 0 writes the gathered weights under data_dir, each replica reads
            # them) and the broadcast source (every sync one gloo group of rank 0 and both replicas, formed
            # at the rendezvous on rank 0's node, which each replica was placed trusting), two steps each.
            for source in ("shared_path", "broadcast"):
                run = client.submit({**sync_spec(model, f"on-ray-{source}", source), "steps": 2})
                done = client.wait(run["id"], timeout_s=300)
                assert done["status"] == "completed", (source, done)
                assert [s["step"] for s in client.metrics(run["id"])["steps"]] == [1, 2]
                synced = [e for e in client.run(run["id"])["events"] if e["event"] == "weights_synced"]
                assert [e["policy_version"] for e in synced] == [1, 2], synced
                assert all(e["replicas"] == sorted(ready["rollouts"]) for e in synced), synced
                # The digest both replicas reported for the last version is the one the trainer's own
                # stream carries for the weights it holds.
                assert _served_weights(ready["trainer"], token, run["id"]) == (2, synced[-1]["digest"]), source
            trainer_log = (tmp_path / "data" / "logs" / "trainer.log").read_text()
            assert trainer_log.count('"weights broadcast"') == 2 and '"world_size": 3' in trainer_log
            assert trainer_log.count('"weights written"') == 2
        finally:
            client.close()

        import ray
        ray.init(address=cluster.address, namespace="lockstep", log_to_driver=False)
        trainer = ray.get(ray.get_actor("trainer").describe.remote())
        rank1 = ray.get(ray.get_actor("trainer-rank-1").describe.remote())
        ray.shutdown()
        assert rank1["exit_codes"] == [-9] and rank1["alive"] and rank1["pid"] != services["trainer-rank-1"]["pid"], rank1
        assert trainer["exit_codes"] == [WORKER_LOST_EXIT] and trainer["alive"], trainer
        assert trainer["pid"] != services["trainer"]["pid"] and trainer["address"] == services["trainer"]["address"]

        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 0, (tmp_path / "launcher.log").read_text()[-4000:]
        pids = [trainer["pid"], rank1["pid"]] + [s["pid"] for n, s in services.items() if not n.startswith("trainer")]
        deadline = time.monotonic() + 30
        while not all(_gone(p) for p in pids):
            assert time.monotonic() < deadline, f"service processes left after SIGTERM: {pids}"
            time.sleep(0.2)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
