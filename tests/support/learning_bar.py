"""Stop a learning run at the first evaluation that clears its test's bar.

A learning test asks whether a run reaches a held-out accuracy; the steps after the first evaluation that shows it
would only cost suite time. `run_until_bar` submits a run, watches its evaluations and cancels it at the first one
for which `cleared(initial, accuracy)` holds. The test then asserts the bar on the evaluation it was stopped at
(`BarRun.accuracy`), so a run that never clears it ends with its last evaluation and fails the same assertion.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.cli.client import CoordinatorClient


@dataclass(frozen=True)
class BarRun:
    run_id: str
    status: str
    """'completed', or 'cancelled' when stopped at the bar (anything else is a failure the test reports)."""
    initial: float | None
    """Held-out accuracy before step 1 (the run's eval_initial), None when the run has none."""
    stopped_at_step: int | None
    """The step of the evaluation that cleared the bar; None when no evaluation did."""
    evals: list[tuple[int, float]]
    """(step, held-out accuracy) of every evaluation the run recorded."""
    steps: list[dict]
    """Every recorded step's metrics, in step order (a cancelled run may have recorded steps past the bar)."""

    @property
    def accuracy(self) -> float | None:
        """The evaluation the bar is judged on: the one that cleared it, else the last one."""
        if self.stopped_at_step is not None:
            return dict(self.evals)[self.stopped_at_step]
        return self.evals[-1][1] if self.evals else None

    @property
    def ended_as_expected(self) -> bool:
        return self.status == "completed" or (self.status == "cancelled" and self.stopped_at_step is not None)


def run_until_bar(client: CoordinatorClient, spec: dict, cleared: Callable[[float | None, float], bool], *,
                  timeout_s: float) -> BarRun:
    """Submit `spec` and wait for it, cancelling it at the first evaluation whose accuracy clears the bar."""
    stopped: dict = {}
    seen = {"step": -1}

    def evals_of(run_id: str) -> list[tuple[int, float]]:
        return [(s["step"], s["metrics"]["eval_accuracy"]) for s in client.metrics(run_id)["steps"]
                if "eval_accuracy" in s["metrics"]]

    def watch(run: dict) -> None:
        if stopped or run["status"] != "running" or run["step"] == seen["step"]:
            return
        seen["step"] = run["step"]
        initial = (client.run(run["id"]).get("eval_initial") or {}).get("accuracy")
        for step, accuracy in evals_of(run["id"]):
            if cleared(initial, accuracy):
                stopped["step"] = step
                client.cancel(run["id"])
                return

    run = client.submit(spec)
    done = client.wait(run["id"], poll_s=0.5, timeout_s=timeout_s, on_update=watch)
    initial = (client.run(run["id"]).get("eval_initial") or {}).get("accuracy")
    evals = evals_of(run["id"])
    if "step" not in stopped:  # the run may have ended between two polls with an evaluation that clears the bar
        stopped["step"] = next((step for step, accuracy in evals if cleared(initial, accuracy)), None)
    steps = [s["metrics"] for s in client.metrics(run["id"])["steps"]]
    return BarRun(run["id"], done["status"], initial, stopped["step"], evals, steps)
