"""A run's experiment trackers, fed off the step path.

Every tracker gets a thread of its own and a bounded queue. The run loop only enqueues (never waits, never
sees an exception): a tracker that raises, cannot be imported or built, falls behind until its queue is
full, or hangs in a call longer than `call_timeout_s`, costs the run nothing but what it would have
logged, and each call it loses is counted (`on_failure`: lockstep_tracking_failures_total and a log line).
A hung tracker is given up on: nothing more is sent to it, and the run's end does not wait for it.

What is logged, under the same names everywhere (`tracker_key`): every step metric under its Prometheus
name (`lockstep_step_<key>`; an eval set's numbers as `lockstep_eval_avg_at_k/<set>/<k>` and
`lockstep_eval_pass_at_k/<set>/<k>`, the gauge's name and labels), the evaluation before step 1 at step 0,
the run spec and platform fingerprint as the run's config, and every `samples_every` steps a table of the
step's first samples.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.metric_defs import step_metric_name
from services.coordinator.tracking.spec import TrackingSpec
from services.coordinator.tracking.trackers import TRACKERS, RunIdentity, Tracker, TrackingTargets

log = logging.getLogger("lockstep.coordinator.tracking")

SAMPLE_COLUMNS = ["step", "sample_id", "prompt", "response", "reward", "advantage", "length", "finish_reason"]
_STOP = object()


def tracker_key(key: str) -> str:
    """A step metric's name in every tracker: its Prometheus name, labels as path segments."""
    if key.startswith("eval/") and key.count("/") == 2 and "@" in key:
        _, eval_set, stat = key.split("/")
        kind, k = stat.split("@", 1)
        return f"lockstep_eval_{kind}_at_k/{eval_set}/{k}"
    if key.startswith("episodes_end_"):
        return f"lockstep_step_episodes_ended/{key.removeprefix('episodes_end_')}"
    return step_metric_name(key)


def tracker_values(metrics: dict) -> dict[str, float]:
    return {tracker_key(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def sample_rows(step: int, samples: list[dict], rows: int) -> list[list]:
    return [[step, s["sample_id"], s["prompt"], s["response"], s["reward"], s["advantage"], s["length"],
             s["finish_reason"]] for s in samples[:rows]]


class TrackerWorker:
    """One tracker on its own daemon thread; `submit` never blocks."""

    def __init__(self, name: str, make: Callable[[], Tracker], on_failure: Callable[[str, str], None], *,
                 queue_size: int, call_timeout_s: float) -> None:
        self.name, self._make, self._on_failure = name, make, on_failure
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._call_timeout_s = call_timeout_s
        self._busy_since: float | None = None
        self._given_up = False  # hung, or could not be built: nothing more is sent
        self._thread = threading.Thread(target=self._work, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def _fail(self, why: str) -> None:
        self._on_failure(self.name, why)

    def _hung(self) -> bool:
        since = self._busy_since
        if not self._given_up and since is not None and time.monotonic() - since > self._call_timeout_s:
            self._given_up = True
            self._fail(f"a call has not returned in {self._call_timeout_s:g} s; tracker given up")
        return self._given_up

    def submit(self, call: Callable[[Tracker], Any], what: str) -> None:
        if self._hung():
            self._fail(f"{what} dropped: tracker given up")
            return
        try:
            self._queue.put_nowait((call, what))
        except queue.Full:
            self._fail(f"{what} dropped: queue full")

    def _work(self) -> None:
        self._busy_since = time.monotonic()
        try:
            tracker = self._make()
        except BaseException as exc:  # noqa: BLE001 - an import or a constructor of any library
            self._given_up = True
            self._fail(f"cannot start: {exc!r}")
            tracker = None
        self._busy_since = None
        while True:
            item = self._queue.get()
            if item is _STOP:
                if tracker is not None and not self._given_up:
                    self._call(tracker, lambda t: t.close(), "close")
                return
            call, what = item
            if tracker is None or self._given_up:
                self._fail(f"{what} dropped: tracker given up")
                continue
            self._call(tracker, call, what)

    def _call(self, tracker: Tracker, call: Callable[[Tracker], Any], what: str) -> None:
        self._busy_since = time.monotonic()
        try:
            call(tracker)
        except BaseException as exc:  # noqa: BLE001 - whatever the library raises, the run goes on
            self._fail(f"{what}: {exc!r}")
        finally:
            self._busy_since = None

    def close(self, deadline: float) -> bool:
        """Let the tracker finish what is queued and end its run, waiting until `deadline` (monotonic); whether
        it did (False: it was or is now given up)."""
        if self._hung():  # given up: its thread ends whenever its call returns; nothing waits for it
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(_STOP)
            return False
        try:
            self._queue.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            self._given_up = True
            self._fail("close dropped: queue full")
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._given_up = True
            self._fail("did not finish before the run's end; tracker given up")
            return False
        return not self._given_up


class RunTracking:
    """The run's trackers (spec.backends), each behind a TrackerWorker. Every method returns at once."""

    def __init__(self, run: RunIdentity, spec: TrackingSpec, targets: TrackingTargets, *, last_step: int,
                 read_samples: Callable[[int], list[dict] | None], on_failure: Callable[[str, str], None],
                 call_timeout_s: float = 30.0, queue_size: int = 256,
                 trackers: dict[str, Callable[[RunIdentity, TrackingTargets], Tracker]] | None = None) -> None:
        self.spec, self.last_step, self._read_samples = spec, last_step, read_samples
        self.call_timeout_s = call_timeout_s
        makers = trackers if trackers is not None else TRACKERS

        def failed(tracker: str, why: str) -> None:
            log.warning("tracker %s failed (run %s): %s", tracker, run.run_id, why)
            on_failure(tracker, why)

        self.workers = [TrackerWorker(name, (lambda name=name: makers[name](run, targets)), failed,
                                      queue_size=queue_size, call_timeout_s=call_timeout_s)
                        for name in spec.backends]

    def _each(self, call: Callable[[Tracker], Any], what: str) -> None:
        for w in self.workers:
            w.submit(call, what)

    def config(self, config: dict) -> None:
        self._each(lambda t: t.config(config), "config")

    def eval_initial(self, metrics: dict) -> None:
        values = tracker_values(metrics)
        self._each(lambda t: t.metrics(0, values), "step 0 metrics")

    def step(self, step: int, metrics: dict) -> None:
        values = tracker_values(metrics)
        self._each(lambda t: t.metrics(step, values), f"step {step} metrics")
        every = self.spec.samples_every
        if every and (step % every == 0 or step == self.last_step):
            rows_wanted = self.spec.samples_rows
            read = self._read_samples

            def table(t: Tracker) -> None:  # read in the tracker's thread: the step path touches no file
                samples = read(step)
                if samples:
                    t.samples(step, SAMPLE_COLUMNS, sample_rows(step, samples, rows_wanted))
            self._each(table, f"step {step} samples")

    def close(self, timeout_s: float | None = None) -> dict[str, bool]:
        """Blocking (call it off the event loop): every tracker flushed and ended, or given up after
        `timeout_s` (default: call_timeout_s) in all. Tracker name -> whether it finished (False: given up;
        a call that raised is counted as it happened, not here)."""
        deadline = time.monotonic() + (self.call_timeout_s if timeout_s is None else timeout_s)
        return {w.name: w.close(deadline) for w in self.workers}
