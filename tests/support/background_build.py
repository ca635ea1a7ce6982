"""A build command (a recipe's `prepare`, say) run in the background while other tests run.

    build = BackgroundBuild.start([sys.executable, "-m", "recipes.x.prepare", ...], cwd=REPO, logs=tmp_dir)
    ...                       # other tests run meanwhile
    report = build.report(timeout_s=1800)   # waits; the JSON object of its last stdout line

The learning tests run in one pytest process, one after the other, and each keeps about one core busy; a build
they wait for later (the reward model, minutes of one thread) started early overlaps with them and uses the core
the rest of the suite leaves idle as it ends. The child's output goes to files (a pipe nobody reads fills and
blocks it), and it dies with the thread that started it (services/common/process/parent_death.py).
"""
from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.process.parent_death import with_parent_death


@dataclass
class BackgroundBuild:
    argv: list[str]
    process: subprocess.Popen
    stdout: Path
    stderr: Path
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    @classmethod
    def start(cls, argv: Sequence[str], *, cwd: Path, logs: Path) -> BackgroundBuild:
        logs.mkdir(parents=True, exist_ok=True)
        stdout, stderr = logs / "build.stdout", logs / "build.stderr"
        with stdout.open("wb") as out, stderr.open("wb") as err:
            process = subprocess.Popen(with_parent_death(list(argv), signal.SIGKILL), cwd=cwd, stdout=out,
                                       stderr=err, stdin=subprocess.DEVNULL)
        return cls(list(argv), process, stdout, stderr)

    def report(self, timeout_s: float) -> dict:
        """Waits for the build; the JSON object its last stdout line holds. A failed or timed-out build raises
        with the command and the tail of its stderr."""
        try:
            code = self.process.wait(timeout=max(0.0, timeout_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.cancel()
            raise AssertionError(f"{self.argv} still ran after {timeout_s} s; stderr: {self._tail()}") from None
        if self.finished is None:
            self.finished = time.monotonic()
        if code != 0:
            raise AssertionError(f"{self.argv} exited {code}; stderr: {self._tail()}")
        return json.loads(self.stdout.read_text().strip().splitlines()[-1])

    @property
    def wall_seconds(self) -> float:
        """From the start to the end of the build (to now while it runs)."""
        return (self.finished or time.monotonic()) - self.started

    def cancel(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def _tail(self, chars: int = 3000) -> str:
        return self.stderr.read_text(errors="replace")[-chars:]
