"""tests/support/cpu_seconds.py: the machine's busy CPU-seconds per test phase, read by bench/suite_durations.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from bench.suite_durations import parse
from tests.conftest import REPO_ROOT
from tests.support.cpu_seconds import busy_seconds

TICKS = 100  # os.sysconf("SC_CLK_TCK") on Linux


def _inner_pytest(test_file, **env: str) -> subprocess.CompletedProcess:
    """A pytest session of its own over `test_file` with the plugin loaded."""
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.support.cpu_seconds", str(test_file)], cwd=test_file.parent, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin", **env})


def test_busy_time_counts_every_non_idle_field_of_the_aggregate_line(monkeypatch):
    monkeypatch.setattr("tests.support.cpu_seconds._TICKS", TICKS)
    #            user nice system idle iowait irq softirq steal guest guest_nice
    stat = "cpu  100 20 30 5000 70 4 6 10 0 0\ncpu0 50 10 15 2500 35 2 3 5 0 0\n"
    assert busy_seconds(stat) == (100 + 20 + 30 + 4 + 6 + 10) / TICKS
    assert busy_seconds("cpu  1 2 3 4 5 6 7\n") == (1 + 2 + 3 + 6 + 7) / TICKS  # a kernel without steal


def test_a_stat_file_without_the_aggregate_line_first_is_refused():
    with pytest.raises(ValueError, match="'cpu' line first"):
        busy_seconds("cpu0 1 2 3 4 5 6 7 8\n")


def test_an_inner_session_writes_a_line_per_phase_that_suite_durations_reads(tmp_path):
    (tmp_path / "test_inner.py").write_text(
        "import time\n"
        "def test_spins():\n"
        "    end = time.process_time() + 0.3\n"
        "    while time.process_time() < end:\n"
        "        pass\n"
        "def test_sleeps():\n"
        "    time.sleep(0.3)\n")
    out = tmp_path / "cpu.txt"
    proc = _inner_pytest(tmp_path / "test_inner.py", LOCKSTEP_CPU_SECONDS_OUT=str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = parse(out.read_text().splitlines())
    inner = files["test_inner.py"]
    assert inner.tests == {"test_inner.py::test_spins", "test_inner.py::test_sleeps"}
    # Busy time of the whole machine: the spinning test's 0.3 CPU-s at least (other processes may add to it).
    seconds = {line.split()[2]: float(line.split()[0][:-1]) for line in out.read_text().splitlines()
               if line.split()[1] == "call"}
    assert seconds["test_inner.py::test_spins"] >= 0.25


def test_xdist_workers_are_refused(tmp_path):
    (tmp_path / "test_inner.py").write_text("def test_nothing():\n    pass\n")
    proc = _inner_pytest(tmp_path / "test_inner.py", PYTEST_XDIST_WORKER="gw0")
    assert proc.returncode != 0 and "run it without -n" in proc.stderr, proc.stdout + proc.stderr
