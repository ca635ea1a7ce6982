"""Run state in Redis: specs, status, step cursor, per-step metrics, events, leases.

Control plane only; trajectories and weights never pass through Redis.

Keys (prefix `lockstep:`):
  runs                 zset  run id -> creation time
  run:<id>             hash  name, status, step (last completed), created_at, updated_at, error
                             (while paused, error says why the run waits)
  run:<id>:spec        str   validated spec JSON
  run:<id>:metrics     hash  step -> metrics JSON (deterministic values only)
  run:<id>:timings     hash  step -> phase timings JSON (wall clock, never compared)
  run:<id>:events      list  JSON events, newest last
  lease:<id>           str   owner token, with a TTL, held by the coordinator driving the run

<id> is always RUN_ID_PATTERN (checked before any key is built): a caller's
string never becomes part of a key.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

ACTIVE = ("pending", "running")
# Not driven, not ended: the run waits for an operator (a full checkpoint disk freed), who resumes it
# (back to pending, then driven on from its cursor) or cancels it.
HELD = ("paused",)
TERMINAL = ("completed", "failed", "cancelled")
STATUSES = ACTIVE + HELD + TERMINAL

# Records a step exactly once: only when the cursor is at step-1, and the
# metrics, timings and cursor move together. Returns 1 if recorded, 0 if that
# step was already recorded, -1 if the cursor is somewhere else.
_RECORD_STEP = """
local cursor = tonumber(redis.call('HGET', KEYS[1], 'step') or '0')
local step = tonumber(ARGV[1])
if cursor >= step then
  if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
  return -1
end
if cursor ~= step - 1 then return -1 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[1], 'step', ARGV[1], 'updated_at', ARGV[4])
return 1
"""


# Moves a run to a new status only from one of the statuses in ARGV[5] (space
# separated; the active ones unless said otherwise): a terminal status
# (completed, failed, cancelled) is final, so a cancel that lands while the
# driver starts or finishes a run is never overwritten, and a paused run moves
# only when resumed or cancelled. Returns 1 if changed.
# The event is pushed first: a script that fails half-way keeps the writes made
# before the error, and an event list that cannot take the event (WRONGTYPE)
# must leave the status untouched too.
_SET_STATUS = """
local current = redis.call('HGET', KEYS[1], 'status')
local allowed = false
for status in string.gmatch(ARGV[5], '%S+') do
  if status == current then allowed = true end
end
if not allowed then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[2], 'error', ARGV[3])
return 1
"""


RUN_ID_PATTERN = r"^[0-9a-f]{12}$"
"""What create_run mints (12 hex digits of a uuid4). Anything else is no run, and never part of a key."""
_RUN_ID = re.compile(RUN_ID_PATTERN)


def is_run_id(value: str) -> bool:
    return isinstance(value, str) and _RUN_ID.fullmatch(value) is not None


class StoreError(RuntimeError):
    pass


# What a lost or not-yet-ready Redis raises (BusyLoadingError, while a restarted
# server replays its append-only file, is a ConnectionError): an outage the
# coordinator waits out, never a reason to fail a run.
OUTAGE_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def is_outage(exc: BaseException) -> bool:
    return isinstance(exc, OUTAGE_ERRORS)


class NotARunId(StoreError, ValueError):
    """A run id that does not match RUN_ID_PATTERN reached the store."""


@dataclass
class RunRecord:
    id: str
    name: str
    status: str
    step: int
    steps: int
    created_at: float
    updated_at: float
    error: str

    def to_dict(self) -> dict:
        return self.__dict__.copy()


class RunStore:
    """Every command is retried `retries` times with exponential backoff (jittered, capped at
    `backoff_max_s`) when the connection is lost; after that the outage error reaches the caller."""

    def __init__(self, url: str, prefix: str = "lockstep:", *, password: str | None = None, retries: int = 5,
                 backoff_max_s: float = 2.0, socket_timeout_s: float = 10.0) -> None:
        # The password is passed beside the URL, never inside it: URLs end up in logs and errors.
        self._r = aioredis.from_url(
            url, decode_responses=True, password=password,
            retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=backoff_max_s), retries,
                        supported_errors=OUTAGE_ERRORS),
            socket_connect_timeout=socket_timeout_s, socket_timeout=socket_timeout_s,
        )
        self._p = prefix
        self._record_step = self._r.register_script(_RECORD_STEP)
        self._set_status = self._r.register_script(_SET_STATUS)

    def _k(self, *parts: str) -> str:
        return self._p + ":".join(parts)

    def _run_key(self, run_id: str, *suffix: str) -> str:
        """`run:<id>[:suffix]`; only for a well-formed id, so `<id>:events` can never name another key."""
        if not is_run_id(run_id):
            raise NotARunId(f"run_id: {run_id!r} is not a run id")
        return self._k("run", run_id, *suffix)

    def _lease_key(self, run_id: str) -> str:
        if not is_run_id(run_id):
            raise NotARunId(f"run_id: {run_id!r} is not a run id")
        return self._k("lease", run_id)

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except Exception:
            return False

    async def close(self) -> None:
        await self._r.aclose()

    async def create_run(self, name: str, spec_json: str, steps: int) -> RunRecord:
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._run_key(run_id, "spec"), spec_json)
            p.hset(self._run_key(run_id), mapping={
                "name": name, "status": "pending", "step": 0, "steps": steps,
                "created_at": now, "updated_at": now, "error": "",
            })
            p.zadd(self._k("runs"), {run_id: now})
            p.rpush(self._run_key(run_id, "events"), json.dumps({"ts": now, "event": "submitted"}))
            await p.execute()
        return await self.get_run(run_id)  # type: ignore[return-value]

    async def import_run(self, run: dict, spec_json: str, steps: list[dict], events: list[dict],
                         aux: dict[str, dict]) -> RunRecord:
        """Store an ended run exported from another deployment under a new id, in one transaction.

        Its status is the one it ended with (never active), so no scheduler ever drives it: an imported
        run is a record to read and compare, not a run to continue."""
        if run["status"] not in TERMINAL:
            raise StoreError(f"status: an imported run must have ended, got {run['status']!r}")
        run_id = uuid.uuid4().hex[:12]
        now = time.time()
        async with self._r.pipeline(transaction=True) as p:
            p.set(self._run_key(run_id, "spec"), spec_json)
            p.hset(self._run_key(run_id), mapping={
                "name": run["name"], "status": run["status"], "step": run["step"], "steps": run["steps"],
                "created_at": run["created_at"], "updated_at": now, "error": run["error"],
            })
            for s in steps:
                p.hset(self._run_key(run_id, "metrics"), str(s["step"]), json.dumps(s["metrics"], sort_keys=True))
                p.hset(self._run_key(run_id, "timings"), str(s["step"]), json.dumps(s["timings"], sort_keys=True))
            for key, value in aux.items():
                p.hset(self._run_key(run_id, "aux"), key, json.dumps(value, sort_keys=True))
            for e in [*events, {"ts": now, "event": "imported", "source_run_id": run["id"]}]:
                p.rpush(self._run_key(run_id, "events"), json.dumps(e))
            p.zadd(self._k("runs"), {run_id: now})
            await p.execute()
        return await self.get_run(run_id)  # type: ignore[return-value]

    async def get_run(self, run_id: str) -> RunRecord | None:
        if not is_run_id(run_id):
            return None
        h = await self._r.hgetall(self._run_key(run_id))
        if not h:
            return None
        return RunRecord(
            id=run_id, name=h["name"], status=h["status"], step=int(h["step"]), steps=int(h["steps"]),
            created_at=float(h["created_at"]), updated_at=float(h["updated_at"]), error=h.get("error", ""),
        )

    async def get_spec_json(self, run_id: str) -> str | None:
        return await self._r.get(self._run_key(run_id, "spec"))

    async def list_runs(self) -> list[RunRecord]:
        ids = await self._r.zrange(self._k("runs"), 0, -1)
        runs = [await self.get_run(i) for i in ids]
        return [r for r in runs if r is not None]

    async def set_status(self, run_id: str, status: str, error: str = "", *,
                         from_statuses: tuple[str, ...] = ACTIVE, event: str = "") -> bool:
        """Atomically move a run that is in one of `from_statuses` (default: active) to `status`, with an
        event named `event` (default: the status); False (nothing written) if the run is in another."""
        if status not in STATUSES or not set(from_statuses) <= set(STATUSES):
            raise StoreError(f"unknown status {status!r} or {from_statuses!r}")
        now = time.time()
        record = json.dumps({"ts": now, "event": event or status, "error": error})
        changed = await self._set_status(
            keys=[self._run_key(run_id), self._run_key(run_id, "events")],
            args=[status, now, error, record, " ".join(from_statuses)],
        )
        return changed == 1

    async def pause(self, run_id: str, reason: str) -> bool:
        """Hold a running run as `paused`, `reason` in its error; False if it is not running."""
        return await self.set_status(run_id, "paused", reason, from_statuses=("running",))

    async def resume(self, run_id: str) -> bool:
        """A paused run back to pending (driven on from its cursor); False if it is not paused."""
        return await self.set_status(run_id, "pending", from_statuses=HELD, event="resumed")

    async def cancel(self, run_id: str) -> bool:
        """An active or paused run cancelled; False if it already ended."""
        return await self.set_status(run_id, "cancelled", from_statuses=ACTIVE + HELD)

    async def add_event(self, run_id: str, event: str, **fields: object) -> None:
        await self._r.rpush(self._run_key(run_id, "events"), json.dumps({"ts": time.time(), "event": event, **fields}))

    async def events(self, run_id: str) -> list[dict]:
        return [json.loads(e) for e in await self._r.lrange(self._run_key(run_id, "events"), 0, -1)]

    async def record_step(self, run_id: str, step: int, metrics: dict, timings: dict) -> bool:
        """Record a completed step exactly once. False if it was already recorded."""
        res = await self._record_step(
            keys=[self._run_key(run_id), self._run_key(run_id, "metrics"), self._run_key(run_id, "timings")],
            args=[step, json.dumps(metrics, sort_keys=True), json.dumps(timings, sort_keys=True), time.time()],
        )
        if res == -1:
            run = await self.get_run(run_id)
            raise StoreError(f"run {run_id}: cannot record step {step}, cursor is at {run.step if run else '?'}")
        return res == 1

    async def step_metrics(self, run_id: str, step: int) -> dict | None:
        """The recorded metrics of one step, None if it was not recorded."""
        raw = await self._r.hget(self._run_key(run_id, "metrics"), str(step))
        return json.loads(raw) if raw is not None else None

    async def metrics(self, run_id: str) -> list[dict]:
        raw = await self._r.hgetall(self._run_key(run_id, "metrics"))
        timings = await self._r.hgetall(self._run_key(run_id, "timings"))
        out = []
        for step in sorted(raw, key=int):
            out.append({"step": int(step), "metrics": json.loads(raw[step]),
                        "timings": json.loads(timings.get(step, "{}"))})
        return out

    async def set_aux(self, run_id: str, key: str, value: dict) -> None:
        """Small per-run documents that are not per-step (e.g. the step-0 evaluation)."""
        await self._r.hset(self._run_key(run_id, "aux"), key, json.dumps(value, sort_keys=True))

    async def get_aux(self, run_id: str, key: str) -> dict | None:
        v = await self._r.hget(self._run_key(run_id, "aux"), key)
        return json.loads(v) if v is not None else None

    async def acquire_lease(self, run_id: str, owner: str, ttl_s: float) -> bool:
        key = self._lease_key(run_id)
        if await self._r.set(key, owner, nx=True, px=int(ttl_s * 1000)):
            return True
        if await self._r.get(key) == owner:
            await self._r.pexpire(key, int(ttl_s * 1000))
            return True
        return False

    async def release_lease(self, run_id: str, owner: str) -> None:
        key = self._lease_key(run_id)
        if await self._r.get(key) == owner:
            await self._r.delete(key)
