"""EventLog against a real redis-server: one call writes the run's event, its structured log line and
its Prometheus side, and a step is recorded and exported exactly once."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import generate_latest

from services.common.process.structured_logging import JsonFormatter
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.coordinator.state.event_log import EventLog, PhaseTimer
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import RunStore


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as r:
        yield r


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter("coordinator"))
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def lines():
    logger = logging.getLogger("test.event_log")
    logger.setLevel(logging.INFO)
    handler = Lines()
    logger.addHandler(handler)
    yield logger, handler.lines
    logger.removeHandler(handler)


def scrape(exporter: CoordinatorExporter) -> str:
    return generate_latest(exporter.registry).decode()


def test_one_call_writes_the_event_the_log_line_and_the_metric(server, lines):
    logger, logged = lines

    async def go():
        store = RunStore(server.url, prefix="ev1:", password=server.password)
        run = await store.create_run("a", "{}", steps=1)
        exporter = CoordinatorExporter()
        events = EventLog(run.id, store, exporter, logger)
        await events.record("trainer_recovered", "trainer recovered",
                            export=lambda e: e.trainer_recovered(run.id), step=3, policy_version=2)
        got = await store.events(run.id)
        await store.close()
        return run.id, got, exporter

    run_id, got, exporter = asyncio.run(go())
    assert [{k: v for k, v in e.items() if k != "ts"} for e in got] == [
        {"event": "submitted"}, {"event": "trainer_recovered", "step": 3, "policy_version": 2}]
    assert [(line["msg"], line["run_id"], line["step"], line["policy_version"]) for line in logged] == [
        ("trainer recovered", run_id, 3, 2)]
    text = scrape(exporter)
    assert f'lockstep_trainer_recoveries_total{{run_id="{run_id}"}} 1.0' in text
    # A recovery with no step to recompute still shows the matched series, at 0; never a differed one.
    assert f'lockstep_steps_recomputed_total{{outcome="matched",run_id="{run_id}"}} 0.0' in text
    assert 'outcome="differed"' not in text


def test_a_step_is_exported_once_and_logged_each_time(server, lines):
    logger, logged = lines
    counts = {"trajectories_trained": 12, "trajectories_dropped": 4}

    async def go():
        store = RunStore(server.url, prefix="ev2:", password=server.password)
        run = await store.create_run("b", "{}", steps=1)
        exporter = CoordinatorExporter()
        events = EventLog(run.id, store, exporter, logger)
        first = await events.record_step(1, {"reward_mean": 0.5, **counts}, {"total": 0.25}, counts, None)
        again = await events.record_step(1, {"reward_mean": 0.75, **counts}, {"total": 0.5}, counts, None)
        recorded = await store.step_metrics(run.id, 1)
        await store.close()
        return run.id, first, again, recorded, exporter

    run_id, first, again, recorded, exporter = asyncio.run(go())
    assert (first, again) == (True, False)
    assert recorded["reward_mean"] == 0.5  # the record is never rewritten
    text = scrape(exporter)
    assert f'lockstep_trajectories_total{{outcome="trained",run_id="{run_id}"}} 12.0' in text
    assert f'lockstep_trajectories_total{{outcome="dropped",run_id="{run_id}"}} 4.0' in text
    assert [(line["msg"], line["step"]) for line in logged] == [("step recorded", 1), ("step recorded", 1)]


def test_phase_timer_records_finished_phases_and_the_total():
    timer = PhaseTimer()
    with timer.phase("rollout"):
        pass
    with pytest.raises(RuntimeError):
        with timer.phase("train"):
            raise RuntimeError("lost")
    seconds = timer.finish()
    assert set(seconds) == {"rollout", "total"}
    assert 0 <= seconds["rollout"] <= seconds["total"]
