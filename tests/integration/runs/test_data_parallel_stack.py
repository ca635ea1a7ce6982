"""The trainer service with --data-parallel 2 (gloo on CPU) in the real stack, and what happens when one
of its ranks dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.auth import TOKEN_ENV, BearerToken, generate_token
from services.common.grpc.options import sync_channel
from services.local_stack import LocalStack, free_port
from services.trainer.distributed.worker_group import WORKER_LOST_EXIT

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


def _spec(model: Path, name: str) -> dict:
    return {"name": name, "model_path": str(model), "seed": 3, "steps": 3,
            "task": {"name": "arithmetic", "options": {"heldout_size": 8}},
            "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "sampling": {"max_new_tokens": 4}},
            "trainer": {"microbatch_tokens": 24}, "eval": {"every": 0, "heldout_size": 8}}


def _run(stack: LocalStack, model: Path, name: str) -> tuple[list[dict], dict]:
    client = stack.client()
    try:
        run = client.submit(_spec(model, name))
        assert client.wait(run["id"], timeout_s=300)["status"] == "completed"
        with sync_channel(f"127.0.0.1:{stack.trainer_port}", stack.token) as ch:
            info = pb_grpc.TrainerStub(ch).Info(pb.InfoRequest(), timeout=10)
        return [s["metrics"] for s in client.metrics(run["id"])["steps"]], dict(info.details)
    finally:
        client.close()


def test_two_rank_trainer_serves_runs_reproducibly(tmp_path, one_replica_stack):
    model = build_model_dir(tmp_path / "model", seed=1)
    with LocalStack(tmp_path / "dp", extra_env={"LOCKSTEP_TRAINER_DATA_PARALLEL": "2"},
                    path_roots=[model.parent]) as stack:
        a, info = _run(stack, model, "dp-a")
        # A fresh trainer and fresh ranks for the second run, so that run-to-run means process-to-process too
        # (the rollout is seeded per sample and holds no state of the run's).
        stack.trainer.stop()
        stack.trainer.start()
        stack.wait_ready()
        b, _ = _run(stack, model, "dp-b")
    # The session's shared stack has a one-rank trainer with default options (tests/integration/conftest.py).
    one, info1 = _run(one_replica_stack, model, "dp-one")
    assert info["data_parallel"] == "2" and info1["data_parallel"] == "1"
    assert a == b  # bitwise, run to run, at a fixed world size
    # Step 1 starts from the same weights: everything but the gradient norm is bitwise that of one rank.
    assert {k: v for k, v in a[0].items() if k != "grad_norm"} == {k: v for k, v in one[0].items() if k != "grad_norm"}
    assert abs(a[0]["iw_mean"] - 1) < 1e-5 and abs(a[-1]["iw_mean"] - 1) < 1e-3


def test_a_dead_rank_takes_the_trainer_service_down(tmp_path):
    port = free_port()
    token = BearerToken(generate_token())
    proc = subprocess.Popen([sys.executable, "-m", "services.trainer", "--grpc-port", str(port), "--metrics-port", "0",
                             "--data-parallel", "2", "--num-threads", "1"], cwd=REPO,
                            env={**os.environ, TOKEN_ENV: token.secret},
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "trainer.log", "wb"))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            try:
                with sync_channel(f"127.0.0.1:{port}", token) as ch:
                    pb_grpc.TrainerStub(ch).Health(pb.HealthRequest(), timeout=2)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline, "trainer never served"
                time.sleep(0.2)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        # The spawn context also starts a resource tracker; the rank is the spawned main.
        ranks = [int(c) for c in children
                 if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(ranks) == 1, [Path(f"/proc/{c}/cmdline").read_bytes() for c in children]
        os.kill(ranks[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == WORKER_LOST_EXIT
        assert "trainer worker lost" in (tmp_path / "trainer.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
