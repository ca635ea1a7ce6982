"""RunScheduler against a real redis-server: no Redis error ends its loop, and it says when it is stuck.

The drivers are stand-ins (the scheduler's contract is with RunDriver.run(): return, raise
RunCancelled, or raise); the store, its scripts and the errors Redis answers are real.
"""
from __future__ import annotations

import asyncio

from recipes.tiny_model import build_model_dir
from services.coordinator.run.run_scheduler import RunScheduler
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.embedded_redis import EmbeddedRedis
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import RunStore


class _FailingDriver:
    async def run(self) -> None:
        raise RuntimeError("the run's own failure")


class _CompletingDriver:
    def __init__(self, store: RunStore, run_id: str) -> None:
        self.store, self.run_id = store, run_id

    async def run(self) -> None:
        await self.store.set_status(self.run_id, "running")
        await self.store.set_status(self.run_id, "completed")


async def _until(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


def test_a_redis_error_inside_the_failure_handler_does_not_end_the_scheduler(tmp_path):
    spec = RunSpec(name="s", model_path=str(build_model_dir(tmp_path / "model", seed=0)), steps=1,
                   task={"name": "arithmetic"}).model_dump_json()

    async def go() -> None:
        with EmbeddedRedis(tmp_path / "redis") as redis:
            store = RunStore(redis.url, prefix="sched:", password=redis.password, retries=0)
            bad = await store.create_run("bad", spec, 1)
            # The run's event list holds a string: recording the failure (RPUSH inside the status
            # script) answers WRONGTYPE -- a Redis error raised from the scheduler's failure handler.
            await store._r.set(f"sched:run:{bad.id}:events", "not a list")
            good = await store.create_run("good", spec, 1)

            def make_driver(run_id, _spec, _run_dir):
                return _FailingDriver() if run_id == bad.id else _CompletingDriver(store, run_id)

            scheduler = RunScheduler(store, make_driver, tmp_path / "runs", "owner", CoordinatorExporter())
            scheduler.start()
            try:
                async def stuck() -> bool:
                    return "WRONGTYPE" in scheduler.last_error

                await _until(stuck, "the scheduler never reported the Redis error")
                assert not scheduler.healthy and not scheduler._task.done()  # alive, and says it is stuck
                assert (await store.get_run(bad.id)).status == "pending"

                await store._r.delete(f"sched:run:{bad.id}:events")  # the operator repairs Redis

                async def both_ended() -> bool:
                    return [(await store.get_run(r.id)).status for r in (bad, good)] == ["failed", "completed"]

                await _until(both_ended, "the scheduler did not get on once Redis answered")
                assert (await store.get_run(bad.id)).error == "RuntimeError: the run's own failure"

                async def recovered() -> bool:
                    return scheduler.healthy

                await _until(recovered, "the scheduler stayed unhealthy after Redis recovered")
            finally:
                await scheduler.stop()
                await store.close()

    asyncio.run(go())


def test_a_redis_outage_inside_a_run_leaves_it_running_to_be_resumed(tmp_path):
    spec = RunSpec(name="s", model_path=str(build_model_dir(tmp_path / "model", seed=0)), steps=1,
                   task={"name": "arithmetic"}).model_dump_json()

    async def go() -> None:
        redis = EmbeddedRedis(tmp_path / "redis").start()
        store = RunStore(redis.url, prefix="out:", password=redis.password, retries=0)
        run = await store.create_run("r", spec, 1)
        attempts = []
        outage = asyncio.Event()

        class _DriverMeetingAnOutage:
            async def run(self) -> None:
                attempts.append(1)
                await store.set_status(run.id, "running")
                if len(attempts) == 1:
                    redis.stop()  # Redis goes away mid-run
                    outage.set()
                    await store.get_run(run.id)  # raises the outage
                await store.set_status(run.id, "completed")

        scheduler = RunScheduler(store, lambda *_: _DriverMeetingAnOutage(), tmp_path / "runs", "owner",
                                 CoordinatorExporter())
        scheduler.start()
        try:
            await asyncio.wait_for(outage.wait(), 60)

            async def unhealthy() -> bool:
                return not scheduler.healthy

            await _until(unhealthy, "the outage was not reported")
            redis.start()  # same port, same append-only file

            async def completed() -> bool:
                return (await store.get_run(run.id)).status == "completed"

            await _until(completed, "the run was not resumed after the outage")
            assert len(attempts) == 2  # driven again from its cursor, never marked failed
            # Driven twice (the second time resumes it), never failed.
            assert [e["event"] for e in await store.events(run.id)] == ["submitted", "running", "running", "completed"]
        finally:
            await scheduler.stop()
            await store.close()
            redis.stop()

    asyncio.run(go())
