"""pytest plugin: the CPU-seconds the whole machine spent in each test phase, as `--durations` lines.

    python -m pytest -p tests.support.cpu_seconds -m "..." tests     # writes $LOCKSTEP_CPU_SECONDS_OUT
    python bench/suite_durations.py cpu-seconds.txt                   # per file, as for wall time

pytest's `--durations` are wall time. Under `make test` three pytest processes share two cores at different
nice levels, so a test's wall time there says little about what it costs: the unit process's tests take about
ten times their idle time. This plugin reads the machine's busy time (/proc/stat: non-idle ticks of every CPU)
before and after each phase, so it counts the service processes, SGLang servers and model builds a test
starts, which the pytest process's own rusage counts only once it reaps them (a session's stack at the end of
the session). It is a test's cost only when the measured pytest process runs alone on an otherwise idle
machine: one process, no xdist (`-n`), nothing else busy. The output is one line per phase
(`12.34s call tests/a/test_b.py::test_c`), written at the end of the session to $LOCKSTEP_CPU_SECONDS_OUT
(default `cpu-seconds.txt` in the working directory). Linux only.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

OUT_ENV = "LOCKSTEP_CPU_SECONDS_OUT"
STAT = Path("/proc/stat")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LINES: list[str] = []


def busy_seconds(stat_text: str) -> float:
    """Non-idle CPU time of the machine since boot from /proc/stat's first (`cpu`) line: user, nice, system,
    irq, softirq and steal ticks (idle and iowait left out; guest time is already inside user)."""
    fields = stat_text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError(f"/proc/stat: expected the aggregate 'cpu' line first, got {fields[:1]}")
    user, nice, system, _idle, _iowait, irq, softirq, *rest = (int(v) for v in fields[1:])
    steal = rest[0] if rest else 0
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _busy() -> float:
    return busy_seconds(STAT.read_text())


def pytest_configure(config: pytest.Config) -> None:
    if not STAT.is_file():
        raise pytest.UsageError("tests.support.cpu_seconds reads /proc/stat: Linux only")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        raise pytest.UsageError("tests.support.cpu_seconds measures the whole machine: run it without -n")


def _timed(item: pytest.Item, phase: str):
    before = _busy()
    yield
    _LINES.append(f"{_busy() - before:.2f}s {phase} {item.nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _timed(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _timed(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    yield from _timed(item, "teardown")


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = Path(os.environ.get(OUT_ENV, "cpu-seconds.txt"))
    out.write_text("\n".join(_LINES) + "\n")
