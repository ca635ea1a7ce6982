"""A pool of sandboxed executions, sized by the operator, and its numbers.

Each execution is its own bubblewrap process tree (started with its own session, so none of it shares the
service's process group); the pool's threads only wait on pipes, so the service's event loop keeps its core
while `workers` sandboxes run. The pool checks the host when it starts (`bwrap.probe`) and refuses to start
without namespaces: there is no unsandboxed path.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from services.common.sandbox.bwrap import probe
from services.common.sandbox.executor import Execution, ExecutionResult, Outcome, run_execution
from services.common.sandbox.settings import SandboxLimits, SandboxSettings

LATENCY_WINDOW = 4096
"""Executions the p50/p99 are computed over (the most recent)."""


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of `values`; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least the first
    return ordered[int(rank) - 1]


class SandboxPool:
    """`run_batch` runs executions `settings.workers` at a time. Use as a context manager, or call close()."""

    def __init__(self, settings: SandboxSettings, limits: SandboxLimits) -> None:
        self.settings, self.limits = settings, limits
        self._bwrap = probe(settings)  # SandboxUnavailable: refuse now, before anything is submitted
        self._threads = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self._outcomes: Counter[str] = Counter()
        self._seconds: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._busy_wall = 0.0  # seconds during which at least one batch was running
        self._last_batch: dict[str, float] = {}

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_one(self, execution: Execution) -> ExecutionResult:
        result = run_execution(self._bwrap, self.settings, self.limits, execution)
        with self._lock:
            self._outcomes[result.outcome.value] += 1
            if result.outcome is not Outcome.REFUSED:
                self._seconds.append(result.seconds)
        return result

    def run_batch(self, executions: Sequence[Execution]) -> list[ExecutionResult]:
        """Results in the order of `executions`; one execution's outcome never affects another's."""
        start = time.monotonic()
        results = list(self._threads.map(self.run_one, executions))
        self._record_batch(len(results), time.monotonic() - start)
        return results

    async def run_batch_async(self, executions: Sequence[Execution]) -> list[ExecutionResult]:
        """As run_batch, awaited on the caller's event loop (which is free meanwhile)."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        results = await asyncio.gather(*(loop.run_in_executor(self._threads, self.run_one, e) for e in executions))
        self._record_batch(len(results), time.monotonic() - start)
        return list(results)

    def _record_batch(self, count: int, seconds: float) -> None:
        with self._lock:
            self._busy_wall += seconds
            self._last_batch = {"executions": float(count), "seconds": seconds,
                                "executions_per_s": count / seconds if seconds > 0 else 0.0}

    def metrics(self) -> dict[str, float]:
        """executions, executions_per_s (over the time batches ran), p50_s and p99_s (recent executions),
        outcome_<name> for every outcome, workers, and the last batch's executions_per_s."""
        with self._lock:
            total = sum(self._outcomes.values())
            out = {"workers": float(self.settings.workers), "executions": float(total),
                   "executions_per_s": total / self._busy_wall if self._busy_wall > 0 else 0.0,
                   "p50_s": percentile(self._seconds, 50), "p99_s": percentile(self._seconds, 99),
                   "last_batch_executions_per_s": self._last_batch.get("executions_per_s", 0.0)}
            for outcome in Outcome:
                out[f"outcome_{outcome.value}"] = float(self._outcomes[outcome.value])
        return out

    def close(self) -> None:
        """Wait for running executions (each ends by its wall bound) and stop the threads."""
        self._threads.shutdown(wait=True, cancel_futures=True)
