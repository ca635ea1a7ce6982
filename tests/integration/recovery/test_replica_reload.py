"""A rollout replica restarted between two calls -- still in service as far as the run knows -- answers
"no model loaded"; the run loop reloads it (model and current weights) instead of failing. Real
trainer and rollout processes and a real Redis; the run loop's phases are called one by one, so the
restart lands exactly between two of them."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.grpc.options import sync_channel
from services.common.models.directory import load_tokenizer
from services.coordinator.clients import RolloutClient, TrainerClient
from services.coordinator.run.loop import RunDriver
from services.coordinator.run.prompts import step_problems
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import RunStore
from services.local_stack import LocalStack, ServiceProcess

pytestmark = pytest.mark.slow


def _wait_serving(port: int, process: ServiceProcess, token, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with sync_channel(f"127.0.0.1:{port}", token) as channel:
        while True:
            assert process.alive(), process.tail()
            try:
                pb_grpc.RolloutStub(channel).Info(pb.InfoRequest(), timeout=2)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, f"{process.name} did not come up:\n{process.tail()}"
                time.sleep(0.2)


def _restart(stack: LocalStack) -> None:
    stack.rollouts[0].kill()
    stack.rollouts[0].start()  # same port, no model loaded
    _wait_serving(stack.rollout_ports[0], stack.rollouts[0], stack.token)


def test_restarted_replica_is_reloaded_on_generate_and_on_weight_sync(tmp_path):
    model = build_model_dir(tmp_path / "model", seed=3)
    stack = LocalStack(tmp_path / "stack", rollout_replicas=1, path_roots=[tmp_path])
    for p in (stack.trainer, stack.rollouts[0]):
        p.start()
    try:
        _wait_serving(stack.rollout_ports[0], stack.rollouts[0], stack.token)
        spec = RunSpec(name="reload", model_path=str(model), seed=5, steps=2, task={"name": "arithmetic"},
                       rollout={"prompts_per_step": 2, "samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}})

        async def go() -> None:
            with EmbeddedRedis(tmp_path / "redis") as redis:
                store = RunStore(redis.url, password=redis.password)
                run = await store.create_run(spec.name, spec.model_dump_json(), spec.steps)
                await store.set_status(run.id, "running")
                rollout = RolloutClient(f"127.0.0.1:{stack.rollout_ports[0]}", 60, stack.token)
                trainer = TrainerClient(f"127.0.0.1:{stack.trainer_port}", 60, stack.token)
                driver = RunDriver(run.id, spec, store, [rollout], trainer, CoordinatorExporter(),
                                   tmp_path / "run", 3, load_tokenizer, replica_recovery_timeout_s=60)
                try:
                    assert await driver._configure_services() == 0
                    problems = step_problems(driver.context.task.split("train"), seed=spec.seed, step=1, count=2)

                    await asyncio.to_thread(_restart, stack)  # between run start and step 1's rollout
                    samples, dropped = await driver.context.rollout(problems, step=1, policy_version=0)
                    assert (len(samples), dropped) == (4, 0)

                    trajectories = await driver.context.score(problems, samples, 1, policy_version=0)
                    header = pb.TrainStepHeader(run_id=run.id, step=1, policy_version=0,
                                                num_trajectories=len(trajectories))
                    assert (await trainer.train_step(header, trajectories)).policy_version == 1
                    await asyncio.to_thread(_restart, stack)  # between the train step and its weight sync
                    await driver.context.fleet.sync_weights(1)  # what a synchronous step's weight sync calls
                    info = await rollout.info()
                    assert (info.run_id, info.policy_version) == (run.id, 1)  # the run's model, current weights

                    reloaded = [e for e in await store.events(run.id) if e["event"] == "replica_reloaded"]
                    assert [(e["step"], e["policy_version"]) for e in reloaded] == [(1, 0), (1, 1)], reloaded
                    assert driver.context.fleet.pool.live() == [rollout]  # never evicted: it answered throughout
                finally:
                    await rollout.close()
                    await trainer.close()
                    await store.close()

        asyncio.run(go())
    finally:
        stack.stop()
