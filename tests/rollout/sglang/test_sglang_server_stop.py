"""SGLangServer.stop() leaves no process and no zombie behind (real child processes, no SGLang).

The case that once failed CI: a multi-threaded server whose main thread is gone
while another thread still runs. /proc then shows the leader as a zombie, so the
process group looks dead, but waitpid() cannot collect it until that last thread
ends; stop() used to return after one non-blocking poll and leave the zombie for
good (signal 0 still finds it, and it holds its slot in the process table).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from services.common.platform import Platform, SGLangPlatformConfig, sglang_launch_plan
from services.rollout.sglang.server import SGLangServer, _group_alive

# Ignores SIGTERM (its Python handler can never run: the main thread is gone),
# then ends its main thread with pthread_exit while a worker keeps the process
# alive for `linger` seconds.
LINGERING_LEADER = """
import ctypes, signal, sys, threading, time
signal.signal(signal.SIGTERM, lambda *_: None)
threading.Thread(target=time.sleep, args=(float(sys.argv[1]),)).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)
"""


def _server_around(proc: subprocess.Popen, tmp_path) -> SGLangServer:
    server = SGLangServer(sys.executable, sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(), {}), host="127.0.0.1", port=0, run_options=(),
                          extra_args=(), log_dir=tmp_path, api_key="k" * 43)
    server.proc = proc
    return server


def _assert_reaped(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # succeeds on an unreaped zombie


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux /proc to see the leader as a zombie")
def test_stop_reaps_a_leader_whose_main_thread_exited_first(tmp_path):
    linger_s = 1.5
    proc = subprocess.Popen([sys.executable, "-c", LINGERING_LEADER, str(linger_s)],
                            stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 5
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The precondition of the bug: the group already reads as gone, yet the
    # process cannot be collected.
    assert not _group_alive(proc.pid)
    assert proc.poll() is None

    started = time.monotonic()
    _server_around(proc, tmp_path).stop(grace_s=10.0)
    assert proc.returncode == 0  # it ran to its own end: SIGTERM was ignored, SIGKILL never needed
    assert time.monotonic() - started < 10.0  # returned once it was collectable, not after the grace
    _assert_reaped(proc.pid)


def test_stop_kills_a_group_that_ignores_sigterm_and_reaps_the_leader(tmp_path):
    # The leader and a grandchild in its session both ignore SIGTERM.
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout.readline().strip() == b"ready"
    _server_around(proc, tmp_path).stop(grace_s=0.5)
    assert proc.returncode == -9  # SIGKILL, after the grace
    assert not _group_alive(proc.pid)
    _assert_reaped(proc.pid)
