"""The sandbox fails closed: a host without bubblewrap or without namespaces gets an error naming what is
missing, and nothing runs; bad settings and oversized programs are refused by name."""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from services.common.sandbox import (
    Execution, Outcome, SandboxLimits, SandboxPool, SandboxSettings, SandboxUnavailable,
)
from services.common.sandbox.pool import percentile
from tests.common.sandbox.sandbox_support import sandbox_pool


def test_a_missing_bubblewrap_refuses_to_start():
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        SandboxPool(SandboxSettings(bwrap="/nonexistent/bwrap"), SandboxLimits())


def test_a_host_without_namespaces_refuses_to_start():
    # A bubblewrap that fails as the real one does where user namespaces are off (a stand-in for the host, not
    # for the sandbox: the point is that the pool never runs a program without it).
    folder = Path(tempfile.mkdtemp(prefix="lockstep-fake-bwrap-"))  # reachable by the uid a root pool drops to
    folder.chmod(0o755)
    fake = folder / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    try:
        with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
            SandboxPool(SandboxSettings(bwrap=str(fake)), SandboxLimits())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_an_interpreter_outside_the_read_only_paths_is_refused():
    with pytest.raises(ValueError, match="python: .* is not inside read_only"):
        SandboxPool(SandboxSettings(python="/usr/bin/python3", read_only=["/opt"]), SandboxLimits())


def test_settings_come_from_the_environment_and_name_a_bad_variable():
    settings = SandboxSettings.from_environment({"LOCKSTEP_SANDBOX_WORKERS": "3",
                                                 "LOCKSTEP_SANDBOX_READ_ONLY": "/usr, /opt/py"})
    assert settings.workers == 3 and settings.read_only == ("/usr", os.path.realpath("/opt/py"))
    with pytest.raises(ValueError, match="LOCKSTEP_SANDBOX_WORKERS"):
        SandboxSettings.from_environment({"LOCKSTEP_SANDBOX_WORKERS": "0"})
    with pytest.raises(ValueError, match="LOCKSTEP_SANDBOX_READ_ONLY"):
        SandboxSettings.from_environment({"LOCKSTEP_SANDBOX_READ_ONLY": "/"})


def test_limits_are_strict():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1)
    with pytest.raises(ValueError, match="wall_s"):
        SandboxLimits(wall_s="10")


def test_oversized_or_binary_programs_are_refused_without_running():
    test = "def check(candidate):\n    assert candidate() == 1\n"
    with sandbox_pool(workers=1, program_bytes=1024) as pool:
        big = pool.run_one(Execution("x = 1\n" * 400, test, "f"))
        nul = pool.run_one(Execution("def f():\n    return 1\n\x00", test, "f"))
        bad_name = pool.run_one(Execution("def f():\n    return 1\n", test, "f; import os"))
        fine = pool.run_one(Execution("def f():\n    return 1\n", test, "f"))
    assert big.outcome is Outcome.REFUSED and "program_bytes=1024" in big.detail
    assert nul.outcome is Outcome.REFUSED and "NUL" in nul.detail
    assert bad_name.outcome is Outcome.REFUSED and "entry_point" in bad_name.detail
    assert fine.outcome is Outcome.PASSED and (fine.passed, fine.total) == (1, 1)


def test_partial_credit_counts_each_assert():
    program = "def f(x):\n    return 2 * x if x < 3 else 0\n"
    test = ("import math\n\ndef check(candidate):\n    seen = []\n    assert candidate(1) == 2\n"
            "    assert candidate(2) == 4\n    assert candidate(5) == 10\n    for x in range(3):\n"
            "        assert candidate(x) == 2 * x\n")
    with sandbox_pool(workers=1) as pool:
        result = pool.run_one(Execution(program, test, "f"))
    assert result.outcome is Outcome.FAILED
    assert (result.passed, result.total) == (3, 4) and result.passed_fraction == 0.75


def test_percentile_is_nearest_rank():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0 and percentile(values, 99) == 5.0 and percentile(values, 1) == 1.0
    assert percentile([], 50) == 0.0


@pytest.mark.parametrize("fail_runs,outcome,invocations", [(1, Outcome.PASSED, 3), (99, Outcome.CRASHED, 4)])
def test_a_sandbox_bubblewrap_could_not_build_is_built_again(fail_runs, outcome, invocations):
    # The real bubblewrap behind a wrapper that, after the pool's probe, fails `fail_runs` times the way
    # bubblewrap does when a namespace limit is reached for a moment.
    real = shutil.which("bwrap")
    if real is None:
        sandbox_pool()  # skips (or fails under LOCKSTEP_REQUIRE_ALL=1) naming what is missing
    folder = Path(tempfile.mkdtemp(prefix="lockstep-flaky-bwrap-"))
    folder.chmod(0o777)  # the uid a root pool drops to keeps the count here
    count = folder / "count"
    count.write_text("0")
    count.chmod(0o666)
    wrapper = folder / "bwrap"
    wrapper.write_text(f"#!/bin/sh\nn=$(($(cat {count}) + 1))\necho $n > {count}\n"
                       f"if [ $n -gt 1 ] && [ $n -le {1 + fail_runs} ]; then\n"
                       "  echo 'bwrap: Creating new namespace failed: Resource temporarily unavailable' >&2\n"
                       f"  exit 1\nfi\nexec {real} \"$@\"\n")
    wrapper.chmod(0o755)
    try:
        with SandboxPool(SandboxSettings(bwrap=str(wrapper), workers=1), SandboxLimits()) as pool:
            result = pool.run_one(Execution("def f():\n    return 1\n", "def check(c):\n    assert c() == 1\n", "f"))
        assert result.outcome is outcome, result
        assert int(count.read_text()) == invocations
        if outcome is Outcome.CRASHED:
            assert "sandbox setup failed: bwrap: Creating new namespace failed" in result.detail
    finally:
        shutil.rmtree(folder, ignore_errors=True)
