"""with_parent_death: the command runs in the launcher's place, and dies when the process that started it dies."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.process.parent_death import with_parent_death, wrapped_command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_command_replaces_the_launcher_and_gets_the_signal_set():
    argv = ["sleep", "30"]
    wrapped = with_parent_death(argv, signal.SIGTERM)
    assert wrapped_command(wrapped) == argv and wrapped_command(argv) == argv
    proc = subprocess.Popen(wrapped)
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.monotonic() < deadline, "the launcher never exec'd the command"
            time.sleep(0.01)
        # Same pid, and the kernel holds the parent-death signal for it (field 'PDeathSig' is not in
        # /proc, so the proof is the next test; here: it is the program, in the launcher's pid).
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep"
    finally:
        proc.kill()
        proc.wait()


def test_the_command_dies_with_the_process_that_started_it(tmp_path):
    # A parent (with a few threads running, as the coordinator has) starts the command, reports its pid,
    # and is SIGKILLed: no cleanup code of its own runs, the kernel's signal alone ends the child.
    pid_file = tmp_path / "child.pid"
    parent_code = (
        "import signal, subprocess, sys, threading, time\n"
        "from services.common.process.parent_death import with_parent_death\n"
        "for _ in range(4): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "p = subprocess.Popen(with_parent_death(['sleep', '60'], signal.SIGTERM))\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], cwd=Path(__file__).resolve().parents[2])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None, "the parent never started its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert _alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        while _alive(child):
            assert time.monotonic() < deadline, f"child {child} outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
