"""Drives active runs one at a time (the services hold one run's model at a time).

Runs are taken oldest first. A run whose driver raises is marked failed with
the error; a cancelled run stops between steps. A coordinator restarted on the
same Redis picks up runs left `running` and resumes them from their cursor.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from collections.abc import Callable
from pathlib import Path

from services.common.structured_logging import log_event
from services.coordinator.exporter import CoordinatorExporter
from services.coordinator.run_loop import RunCancelled, RunDriver
from services.coordinator.run_spec import RunSpec
from services.coordinator.store import ACTIVE, RunStore

log = logging.getLogger("lockstep.coordinator.scheduler")

LEASE_TTL_S = 30.0


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

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="run-scheduler")

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _next_run(self) -> str | None:
        for run in await self.store.list_runs():
            if run.status in ACTIVE:
                return run.id
        return None

    async def _loop(self) -> None:
        while True:
            run_id = await self._next_run()
            if run_id is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=5.0)
                except asyncio.TimeoutError:
                    pass
                continue
            if not await self.store.acquire_lease(run_id, self.owner, LEASE_TTL_S):
                await asyncio.sleep(1.0)  # another coordinator drives it
                continue
            await self._drive(run_id)

    async def _drive(self, run_id: str) -> None:
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
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the run fails loudly, the coordinator keeps serving
            log.exception("run failed")
            await self.store.set_status(run_id, "failed", error=describe_failure(exc))
        finally:
            run = await self.store.get_run(run_id)
            self.exporter.run_active(run_id, run is not None and run.status == "running")
            renew.cancel()
            self.current_run = None
            await self.store.release_lease(run_id, self.owner)

    def _prepare(self, run_id: str, spec_json: str) -> RunDriver:
        return self.make_driver(run_id, RunSpec.model_validate_json(spec_json), self.data_dir / run_id)

    async def _renew(self, run_id: str) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            await self.store.acquire_lease(run_id, self.owner, LEASE_TTL_S)
