"""Drives active runs one at a time (the services hold one run's model at a time).

Runs are taken oldest first. A run whose driver raises is marked failed with
the error; a cancelled run stops between steps. A run that cannot go on until
an operator acts (RunPaused: its checkpoint disk is full) is held as `paused`,
which is not driven, and the scheduler goes on to the next run; resumed, it is
pending again. A coordinator restarted on the same Redis picks up runs left
`running` and resumes them from their cursor.

Redis going away is not a run's failure: the run stays `running`, the
scheduler keeps trying (with backoff) and, once Redis answers again, drives it
on from its cursor exactly as a restarted coordinator would. No error of any
kind ends the scheduler's loop; `healthy` is False while its last attempt
failed, and /readyz reports it.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from collections.abc import Callable
from pathlib import Path

from services.common.process.structured_logging import log_event
from services.coordinator.run.loop import RunCancelled, RunDriver, RunPaused
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import ACTIVE, RunStore, is_outage

log = logging.getLogger("lockstep.coordinator.scheduler")

LEASE_TTL_S = 30.0
RETRY_BACKOFF_MAX_S = 5.0


def describe_failure(exc: BaseException) -> str:
    """The error a failed run records: a service's own diagnostic (e.g. the parity gate's) verbatim."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


class RunScheduler:
    def __init__(self, store: RunStore, make_driver: Callable[[str, RunSpec, Path], RunDriver],
                 data_dir: Path, owner: str, exporter: CoordinatorExporter) -> None:
        self.store, self.make_driver, self.data_dir, self.owner = store, make_driver, data_dir, owner
        self.exporter = exporter
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.current_run: str | None = None
        self.last_error = ""  # why the scheduler cannot make progress right now ("" = it can)

    @property
    def healthy(self) -> bool:
        """The loop runs and its last attempt to find or drive a run reached Redis."""
        return self._task is not None and not self._task.done() and not self.last_error

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="run-scheduler")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        # Cancelled again until it ends: a cancel can still be absorbed by code the loop awaits
        # (a library's own wait_for), and one absorbed cancel must not leave stop() waiting forever.
        while self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        if self._task is not None and not self._task.cancelled() and self._task.exception() is not None:
            log_event(log, "scheduler loop ended with an error", error=describe_failure(self._task.exception()))

    async def _next_run(self) -> str | None:
        for run in await self.store.list_runs():
            if run.status in ACTIVE:
                return run.id
        return None

    async def _loop(self) -> None:
        backoff = 0.5
        while True:
            try:
                await self._schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - nothing may end the loop: runs would wait forever
                self.last_error = describe_failure(exc)
                log.warning("scheduler cannot make progress; retrying", extra={"fields": {
                    "error": self.last_error, "retry_in_s": backoff, "run_store_outage": is_outage(exc)}})
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, RETRY_BACKOFF_MAX_S)
                continue
            backoff = 0.5

    async def _schedule_once(self) -> None:
        """Find the next active run and drive it; wait for a submit when there is none."""
        run_id = await self._next_run()
        self.last_error = ""
        if run_id is None:
            self._wake.clear()
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner result when
            # a cancel arrives just as the wait completes, swallowing the cancel, and stop() then
            # waited forever for a loop that kept going.
            try:
                async with asyncio.timeout(5.0):
                    await self._wake.wait()
            except TimeoutError:
                pass
            return
        if not await self.store.acquire_lease(run_id, self.owner, LEASE_TTL_S):
            await asyncio.sleep(1.0)  # another coordinator drives it
            return
        await self._drive(run_id)

    async def _drive(self, run_id: str) -> None:
        """Drive one run until it ends. A Redis outage inside raises (the run stays `running`)."""
        self.current_run = run_id
        renew = asyncio.create_task(self._renew(run_id))
        self.exporter.run_active(run_id, True)
        try:
            spec_json = await self.store.get_spec_json(run_id) or "{}"
            # Validating the spec and building its task read datasets: in a worker thread, not on the event loop.
            driver = await asyncio.to_thread(self._prepare, run_id, spec_json)
            await driver.run()
        except RunCancelled:
            log_event(log, "run cancelled", run_id=run_id)
        except RunPaused as exc:
            paused = await self.store.pause(run_id, str(exc))
            log_event(log, "run paused" if paused else "run ended while pausing", run_id=run_id, reason=str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the run fails loudly, the coordinator keeps serving
            if is_outage(exc):
                raise  # not the run's fault: it is resumed from its cursor once Redis answers
            log.exception("run failed")
            await self.store.set_status(run_id, "failed", error=describe_failure(exc))
        finally:
            renew.cancel()
            self.current_run = None
        run = await self.store.get_run(run_id)
        self.exporter.run_active(run_id, run is not None and run.status == "running")
        await self.store.release_lease(run_id, self.owner)

    def _prepare(self, run_id: str, spec_json: str) -> RunDriver:
        return self.make_driver(run_id, RunSpec.model_validate_json(spec_json), self.data_dir / run_id)

    async def _renew(self, run_id: str) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                await self.store.acquire_lease(run_id, self.owner, LEASE_TTL_S)
            except Exception as exc:  # noqa: BLE001 - the driver meets the same outage and reports it
                log_event(log, "lease renewal failed", run_id=run_id, error=describe_failure(exc))
