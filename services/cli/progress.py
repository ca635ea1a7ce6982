"""Live progress of a run: a rich progress bar fed by the run's REST status."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _fmt(value: object, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


class RunProgress:
    """Callable for CoordinatorClient.wait(on_update=...)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._progress = Progress(
            TextColumn("[bold]{task.fields[name]}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TextColumn("reward {task.fields[reward]}"),
            TextColumn("acc {task.fields[acc]}"), TextColumn("IW {task.fields[iw]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        )
        self._task = None
        self._acc: float | None = None

    def __enter__(self) -> "RunProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def __call__(self, run: dict) -> None:
        latest = (run.get("latest") or {}).get("metrics", {})
        if "eval_accuracy" in latest:
            self._acc = latest["eval_accuracy"]
        elif self._acc is None and run.get("eval_initial"):
            self._acc = run["eval_initial"]["accuracy"]
        fields = dict(name=run["name"], status=run["status"], reward=_fmt(latest.get("reward_mean"), ".3f"),
                      acc=_fmt(self._acc, ".3f"), iw=_fmt(latest.get("iw_mean"), ".5f"))
        if self._task is None:
            self._task = self._progress.add_task("run", total=run["steps"], completed=run["step"], **fields)
        else:
            self._progress.update(self._task, completed=run["step"], **fields)
