"""Fixed-lag async RL: the version arithmetic (pure), and a replica that reports samples of another
policy version than its step's, refused over real gRPC with the refusal recorded in a real Redis."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken
from services.coordinator.clients import RolloutClient
from services.coordinator.fleet import RolloutFleet
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.fixed_lag import (
    BusyIntervals,
    behaviour_version,
    overlap_seconds,
    rollouts_at,
    staleness_metrics,
)
from services.coordinator.run.prompts import SamplingPlan
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.coordinator.state.event_log import EventLog
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import RunStore
from services.coordinator.tasks.base import Problem


@pytest.mark.parametrize("k", [0, 1, 2, 5])
def test_every_step_samples_exactly_the_lagged_version(k):
    for step in range(1, 20):
        assert behaviour_version(step, k) == max(0, step - 1 - k)
    with pytest.raises(ValueError):
        behaviour_version(0, k)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_later_rollout_is_made_once_by_its_version_while_an_earlier_step_trains(k):
    steps = 12
    made = {1: 0}  # the first step's rollout is made before anything trains (version 0)
    for s in range(1, steps + 1):  # while step s trains, the replicas hold version s - 1
        for later in rollouts_at(s - 1, s, k, steps):
            assert later not in made, (s, later)
            made[later] = s - 1
    assert made == {t: behaviour_version(t, k) for t in range(1, steps + 1)}


def test_staleness_metrics_and_a_version_outside_the_bound():
    assert staleness_metrics(4, [1, 1, 2, 3], 2) == {"staleness_max": 2.0, "staleness_mean": 1.25}
    with pytest.raises(ValueError, match=r"step 4: trajectories of policy versions \[0\]"):
        staleness_metrics(4, [0, 1], 2)
    with pytest.raises(ValueError, match=r"step 4: trajectories of policy versions \[4\]"):
        staleness_metrics(4, [4], 2)


def test_overlap_of_busy_intervals():
    assert overlap_seconds((0, 2), (1, 5)) == 1 and overlap_seconds((0, 1), (2, 3)) == 0
    busy = BusyIntervals()
    busy.add(0, 1)
    busy.add(2, 4)
    assert busy.busy_seconds() == 3 and busy.overlap_with((0.5, 3)) == 1.5
    # A call still in flight is busy up to the end of the window asked about (a streamed rollout may be
    # paused only after the step it overlapped was recorded), and only its own span once it returned.
    busy.begin(5)
    assert busy.overlap_with((4.5, 8)) == 3 and busy.overlap_with((0, 4.5)) == 3
    busy.add(5, 6)
    assert busy.in_flight == [] and busy.overlap_with((4.5, 8)) == 1
    busy.forget_before(3)
    assert busy.spans == [(2, 4), (5, 6)]


class _LyingRollout(pb_grpc.RolloutServicer):
    """Answers every Generate with samples it says version `requested + 1` made."""

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        samples = [pb.Sample(group_id=p.group_id, sample_id=f"{p.group_id}/{i}", index=i)
                   for p in request.prompts for i in range(request.samples_per_prompt)]
        return pb.GenerateResponse(samples=samples, policy_version=request.policy_version + 1, engine="torch")


def test_a_replica_reporting_another_version_is_refused_naming_the_step(tmp_path):
    async def go():
        server = grpc.aio.server()
        pb_grpc.add_RolloutServicer_to_server(_LyingRollout(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with EmbeddedRedis(tmp_path / "redis") as redis:
            store = RunStore(redis.url, prefix="lag:", password=redis.password)
            run_id = (await store.create_run("lag", "{}", steps=3)).id
            events = EventLog(run_id, store, CoordinatorExporter(), logging.getLogger("test.fixed_lag"))
            client = RolloutClient(f"127.0.0.1:{port}", 10.0, BearerToken("t" * 32))

            async def not_cancelled() -> None:
                return None

            fleet = RolloutFleet(run_id, None, [client], "unused", events, generate_retries=0,
                                 recovery_timeout_s=0.0, check_cancelled=not_cancelled)
            plan = SamplingPlan(pb.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2), 2, ("s", 0, 3))
            try:
                with pytest.raises(RunFailed) as exc:
                    await fleet.generate([Problem("p0", "1+1=", "2")], plan, lambda p: [1, 2], step=3,
                                         policy_version=1)
                refused = [e for e in await store.events(run_id) if e["event"] == "rollout_version_refused"]
            finally:
                await server.stop(None)
        return str(exc.value), refused

    message, refused = asyncio.run(go())
    assert message.startswith("step 3: ") and "policy version 2" in message and "version 1" in message
    assert [(e["step"], e["reported"], e["expected"]) for e in refused] == [(3, 2, 1)]


def test_the_exporter_turns_overlap_seconds_into_a_fraction_and_not_a_phase():
    from prometheus_client import generate_latest

    exporter = CoordinatorExporter()
    exporter.max_staleness("r1", 2)
    exporter.on_step("r1", 3, {"staleness_max": 2.0, "staleness_mean": 1.5},
                     {"rollout": 1.0, "train": 1.5, "overlap": 0.5, "total": 2.0})
    text = generate_latest(exporter.registry).decode()
    assert 'lockstep_step_overlap_fraction{run_id="r1"} 0.25' in text
    assert 'lockstep_step_staleness_max{run_id="r1"} 2.0' in text
    assert 'lockstep_step_staleness_mean{run_id="r1"} 1.5' in text
    assert 'lockstep_run_max_staleness{run_id="r1"} 2.0' in text
    assert 'phase="overlap"' not in text and 'phase="train"' in text
