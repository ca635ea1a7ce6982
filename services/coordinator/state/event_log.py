"""A run's record of what happened: one call writes the run's event (Redis), the structured log line
and the Prometheus update together, so the three never disagree about an event.

Also the phase timer of one step (`PhaseTimer`), whose readings are recorded with the step."""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from services.common.process.structured_logging import log_event
from services.coordinator.state.exporter import CoordinatorExporter
from services.coordinator.state.store import RunStore

if TYPE_CHECKING:
    from services.coordinator.run.evaluation import EvalReport

Export = Callable[[CoordinatorExporter], None]


class EventLog:
    def __init__(self, run_id: str, store: RunStore, exporter: CoordinatorExporter, logger: logging.Logger) -> None:
        self.run_id, self.store, self.exporter, self.logger = run_id, store, exporter, logger

    async def record(self, event: str, message: str, *, export: Export | None = None, **fields: object) -> None:
        """Append `event` with `fields` to the run's events, log `message` with the same fields, and
        apply `export` (the Prometheus side of the event, if it has one)."""
        await self.store.add_event(self.run_id, event, **fields)
        log_event(self.logger, message, run_id=self.run_id, **fields)
        if export is not None:
            export(self.exporter)

    async def record_step(self, step: int, metrics: dict, timings: dict, counts: dict,
                          report: EvalReport | None) -> bool:
        """Record a completed step exactly once (Redis) and export it; False, with nothing exported, if
        the step was recorded before. The step's log line is written either way."""
        recorded = await self.store.record_step(self.run_id, step, metrics, timings)
        if recorded:
            self.exporter.on_step(self.run_id, step, metrics, timings)
            if report is not None:
                self.exporter.on_eval(self.run_id, report)
            for outcome in ("trained", "dropped", "filtered", "surplus"):
                self.exporter.trajectories(self.run_id, outcome, counts.get(f"trajectories_{outcome}", 0))
        log_event(self.logger, "step recorded", run_id=self.run_id, step=step,
                  reward_mean=metrics.get("reward_mean"), iw_mean=metrics.get("iw_mean"),
                  eval_accuracy=metrics.get("eval_accuracy"), seconds=round(timings["total"], 3))
        return recorded

    def note(self, message: str, *, export: Export | None = None, **fields: object) -> None:
        """A log line (and its Prometheus side) for what is no event of the run's history."""
        log_event(self.logger, message, run_id=self.run_id, **fields)
        if export is not None:
            export(self.exporter)


class PhaseTimer:
    """Wall-clock seconds per phase of one step, plus `total` since the timer was made."""

    def __init__(self) -> None:
        self._start = time.monotonic()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as `name` (added to earlier blocks of that name); a block that raises records
        nothing (the step is not recorded)."""
        began = time.monotonic()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - began

    def finish(self) -> dict[str, float]:
        self.seconds["total"] = time.monotonic() - self._start
        return self.seconds
