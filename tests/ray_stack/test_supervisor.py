"""ServiceSupervisor with real child processes (no Ray needed)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.ray_stack.supervisor import ServiceSupervisor


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _supervisor(tmp_path, code: str, max_restarts: int) -> ServiceSupervisor:
    return ServiceSupervisor([sys.executable, "-c", code], env=dict(os.environ), log_path=tmp_path / "svc.log",
                             max_restarts=max_restarts, restart_delay_s=0.05)


def test_a_killed_service_is_restarted_and_its_exit_recorded(tmp_path):
    sup = _supervisor(tmp_path, "import time; time.sleep(60)", max_restarts=3)
    sup.start()
    try:
        first = sup.status().pid
        os.kill(first, signal.SIGKILL)
        _wait(lambda: sup.status().restarts == 1 and sup.status().alive)
        st = sup.status()
        assert st.pid != first and st.exit_codes == (-9,) and not st.gave_up
    finally:
        assert sup.stop(grace_s=5) == -signal.SIGTERM
    assert sup.status().restarts == 1  # stopping is not an exit to restart from


def test_a_held_service_that_exits_stays_down(tmp_path):
    # What the launcher does to every service before stopping the stack: trainer rank 0 stopping ends
    # its other ranks, and those must not be started again.
    sup = _supervisor(tmp_path, "import time; time.sleep(60)", max_restarts=3)
    sup.start()
    pid = sup.status().pid
    sup.hold()
    os.kill(pid, signal.SIGKILL)
    sup._thread.join(timeout=20)  # the watcher ends rather than restarting
    st = sup.status()
    assert not sup._thread.is_alive() and not st.alive and st.pid == pid and st.restarts == 0
    assert sup.stop() == -signal.SIGKILL


def test_restart_budget_is_finite_and_then_it_gives_up(tmp_path):
    sup = _supervisor(tmp_path, "import sys; print('boom', flush=True); sys.exit(3)", max_restarts=2)
    sup.start()
    _wait(lambda: sup.status().gave_up)
    st = sup.status()
    assert st.exit_codes == (3, 3, 3) and st.restarts == 2 and not st.alive
    assert (tmp_path / "svc.log").read_text().count("boom") == 3  # every attempt logs to the same file
    sup.stop()


def test_service_dies_with_a_killed_owner(tmp_path):
    # The owner (a Ray actor in production) is SIGKILLed: no stop() runs, the kernel's parent-death
    # signal takes the service down, so a restarted owner finds the service's port free.
    owner_code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from services.ray_stack.supervisor import ServiceSupervisor\n"
        f"sup = ServiceSupervisor([sys.executable, '-c', 'import time; time.sleep(60)'], env=dict(os.environ), "
        f"log_path=Path({str(tmp_path / 'svc.log')!r}), max_restarts=5, restart_delay_s=0.05)\n"
        "sup.start()\n"
        "print(sup.status().pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    service_pid = int(owner.stdout.readline())
    assert not _gone(service_pid)
    owner.kill()
    owner.wait()
    _wait(lambda: _gone(service_pid), timeout_s=10)


@pytest.mark.parametrize("grace_s, expected", [(5.0, -signal.SIGTERM), (0.3, -signal.SIGKILL)])
def test_stop_terminates_then_kills(tmp_path, grace_s, expected):
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN); " if expected == -signal.SIGKILL else ""
    code = f"import signal, time; {ignore}print('ready', flush=True); time.sleep(60)"
    sup = _supervisor(tmp_path, code, max_restarts=3)
    sup.start()
    # The child says when its handler is in place (a fixed sleep was too short on a loaded host: SIGTERM came
    # first and ended it with -15).
    _wait(lambda: "ready" in (tmp_path / "svc.log").read_text())
    assert sup.stop(grace_s=grace_s) == expected
    assert sup.status().restarts == 0
