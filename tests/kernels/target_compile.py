"""`python -m kernels.check_targets` as a background process the suite starts early.

The AOT compile of every kernel for MI300 and Hopper is one to two minutes of single-threaded compiler
work and needs nothing from the rest of the suite, which leaves about half of a 2-core host idle. So
when the check is among the collected tests, tests/kernels/conftest.py starts it as soon as collection
ends, leaving one core to the suite, and the test reads its report when its turn comes; run alone, the test
starts it then, with every core. Either way it is the same command on a fresh Triton cache, and the test asserts the
same report.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.process.parent_death import with_parent_death

TEST_FILE = "tests/kernels/test_logprob_check_targets.py"


@dataclass
class CheckTargetsProcess:
    """One run of the check: its process, and the files its report and errors go to."""

    proc: subprocess.Popen
    workdir: tempfile.TemporaryDirectory

    @classmethod
    def start(cls, repo_root: Path, jobs: int) -> "CheckTargetsProcess":
        workdir = tempfile.TemporaryDirectory(prefix="check-targets-")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = str(Path(workdir.name) / "cache")  # compile for real, not from a cache
        with open(Path(workdir.name) / "report.json", "wb") as out, open(Path(workdir.name) / "stderr", "wb") as err:
            # Killed with the suite if the suite dies before it reads the report.
            command = with_parent_death([sys.executable, "-m", "kernels.check_targets", "--jobs", str(jobs)],
                                        signal.SIGKILL)
            proc = subprocess.Popen(command,
                                    cwd=repo_root, env=env, stdout=out, stderr=err)
        return cls(proc, workdir)

    def result(self, timeout_s: float) -> tuple[int, str, str]:
        """(exit status, report, stderr) once the process ends."""
        code = self.proc.wait(timeout=timeout_s)
        root = Path(self.workdir.name)
        return code, (root / "report.json").read_text(), (root / "stderr").read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.workdir.cleanup()


STARTED = pytest.StashKey[CheckTargetsProcess]()
"""Where the session keeps the check it started after collection."""


def can_start() -> bool:
    """Triton and hipcc are here (else the test reports which is missing)."""
    import importlib.util
    import shutil

    return importlib.util.find_spec("triton") is not None and shutil.which("hipcc") is not None
