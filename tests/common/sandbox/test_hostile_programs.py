"""Hostile programs in the real bubblewrap sandbox: each ends only its own execution, with a named outcome, and
leaves the host as it was (no survivor, no file outside scratch, no secret read, no connection, no kill).

They run as one batch in one pool, as a run's samples would, beside well-behaved programs that must still pass.
"""
from __future__ import annotations

import os
import socket
import subprocess
import uuid

import pytest

from services.common.sandbox import Execution, Outcome
from tests.common.sandbox.sandbox_support import processes_with, sandbox_pool

ADD = "def add(a, b):\n    return a + b\n"
TEST = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"


def hostile(body: str) -> Execution:
    """`body` runs when the program is loaded; the tests after it would pass if it ever returned normally."""
    return Execution(body + "\n" + ADD, TEST, "add")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A deployment's secrets as the coordinator has them: a token file and a variable in this process."""
    secret = f"lockstep-secret-{uuid.uuid4().hex}"
    token = tmp_path_factory.mktemp("deploy") / "token"
    token.write_text(secret)
    os.environ["LOCKSTEP_TEST_PLANTED_SECRET"] = secret
    yield secret, token
    del os.environ["LOCKSTEP_TEST_PLANTED_SECRET"]


@pytest.fixture(scope="module")
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def bystander():
    """A host process the sandbox must not be able to kill."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def batch(planted, listener, bystander, tmp_path_factory):
    secret, token = planted
    outside = tmp_path_factory.mktemp("outside")
    marker = f"9{uuid.uuid4().int % 10**8}"
    port = listener.getsockname()[1]
    programs = {
        "good": Execution(ADD, TEST, "add"),
        "wrong": Execution("def add(a, b):\n    return a - b\n", TEST, "add"),
        "fork_bomb": hostile("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
        "memory_bomb": hostile("blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))"),
        "infinite_loop": hostile("while True:\n    pass"),
        "sleep": hostile("import time\ntime.sleep(10**6)"),
        "output_flood": hostile("import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)"),
        "write_outside": hostile(
            "import os\nfor path in [%r, '/usr/escaped', '/escaped', '/proc/escaped']:\n"
            "    try:\n        open(path, 'w').write('escaped')\n        print('WROTE', path)\n"
            "    except OSError as exc:\n        print('refused', path, type(exc).__name__)\n"
            "open('/tmp/scratch_file', 'w').write('fine')\nprint('SCRATCH', open('/tmp/scratch_file').read())"
            % str(outside / "escaped")),
        "read_secrets": hostile(
            "import os\nfound = []\n"
            "for path in [%r, '/proc/%d/environ', '/proc/1/environ', '/proc/self/environ']:\n"
            "    try:\n        found.append(open(path, 'rb').read()[:4000])\n    except OSError as exc:\n"
            "        print('refused', path, type(exc).__name__)\n"
            "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n        try:\n"
            "            found.append(open('/proc/%%s/environ' %% pid, 'rb').read())\n"
            "        except OSError:\n            pass\n"
            "print(b'|'.join(found)[-1500:])\nprint(sorted(os.environ))" % (str(token), os.getpid())),
        "sockets": hostile(
            "import socket\nfor host in ['127.0.0.1', 'localhost', '::1']:\n    try:\n"
            "        socket.create_connection((host, %d), timeout=2)\n        print('CONNECTED', host)\n"
            "    except OSError as exc:\n        print('refused', host, type(exc).__name__)\n" % port),
        "kill_others": hostile(
            "import os, signal\nfor pid in [%d, 1, 2]:\n    try:\n        os.kill(pid, signal.SIGKILL)\n"
            "    except OSError as exc:\n        print('refused', pid, type(exc).__name__)" % bystander.pid),
        "background_child": hostile(
            "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execv('/usr/bin/sleep', ['sleep', '%s'])\n    os._exit(0)\n" % marker),
        "ctypes_crash": hostile("import ctypes\nctypes.string_at(0)"),
        "exits_early": hostile("import os\nos._exit(0)"),
    }
    with sandbox_pool(workers=2, wall_s=3.0, cpu_s=2, memory_mb=256, output_bytes=1 << 20) as pool:
        results = pool.run_batch(list(programs.values()))
        metrics = pool.metrics()
    return dict(zip(programs, results)), metrics, outside, marker


@pytest.mark.parametrize(("name", "outcome", "detail"), [
    ("good", Outcome.PASSED, ""),
    ("wrong", Outcome.FAILED, "AssertionError"),
    ("fork_bomb", Outcome.TIMEOUT, ""),
    ("memory_bomb", Outcome.FAILED, "MemoryError"),
    ("infinite_loop", Outcome.TIMEOUT, ""),  # CPU or wall bound, whichever the shared cores reach first
    ("sleep", Outcome.TIMEOUT, "wall_s"),
    ("output_flood", Outcome.OUTPUT_LIMIT, "output_bytes"),
    ("ctypes_crash", Outcome.CRASHED, "SIGSEGV"),
    ("exits_early", Outcome.CRASHED, "without a verdict"),
    ("background_child", Outcome.PASSED, ""),  # its own tests pass; what matters is that the child is gone
])
def test_each_program_ends_with_its_named_outcome(batch, name, outcome, detail):
    result = batch[0][name]
    assert result.outcome is outcome, (name, result)
    assert detail in result.detail


def test_writes_land_only_in_scratch(batch):
    result = batch[0]["write_outside"]
    assert result.outcome is Outcome.PASSED
    assert "WROTE" not in result.output_tail
    assert "SCRATCH fine" in result.output_tail  # the scratch directory is writable
    assert not (batch[2] / "escaped").exists()
    assert not os.path.exists("/usr/escaped") and not os.path.exists("/escaped")


def test_no_secret_reaches_the_program(batch, planted):
    secret, _ = planted
    result = batch[0]["read_secrets"]
    assert result.outcome is Outcome.PASSED
    assert "refused" in result.output_tail  # the token file's path does not exist in the sandbox
    for each in batch[0].values():
        assert secret not in each.output_tail and secret not in each.detail
    # Its environment is the sandbox's own variables (and PWD and the locale Python and bubblewrap add),
    # nothing of this process's.
    names = eval(result.output_tail.rstrip().splitlines()[-1])  # the sorted list of names the program printed
    assert set(names) <= {"HOME", "PATH", "PYTHONHASHSEED", "PWD", "LC_CTYPE"}, names
    assert "LOCKSTEP_TEST_PLANTED_SECRET" not in result.output_tail


def test_no_connection_reaches_the_host(batch, listener):
    result = batch[0]["sockets"]
    assert result.outcome is Outcome.PASSED
    assert "CONNECTED" not in result.output_tail
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever connected


def test_host_processes_cannot_be_killed(batch, bystander):
    result = batch[0]["kill_others"]
    assert result.outcome is Outcome.PASSED, result  # pid 1 is the program itself, the namespace's init
    assert "refused %d" % bystander.pid in result.output_tail  # no such process in its namespace
    assert bystander.poll() is None


def test_no_process_survives_its_sandbox(batch):
    assert processes_with(batch[3]) == []
    children = subprocess.run(["ps", "--no-headers", "-o", "pid,args", "--ppid", str(os.getpid())],
                              capture_output=True, text=True).stdout
    assert "bwrap" not in children  # every bubblewrap was reaped


def test_the_pool_counts_every_outcome(batch):
    results, metrics = batch[0], batch[1]
    assert metrics["executions"] == len(results)
    for outcome in Outcome:
        assert metrics[f"outcome_{outcome.value}"] == sum(r.outcome is outcome for r in results.values())
    assert 0 < metrics["p50_s"] <= metrics["p99_s"]


def test_the_cpu_bound_is_the_kernels():
    # A wall bound far past the CPU bound: only RLIMIT_CPU can end it this early.
    with sandbox_pool(workers=1, wall_s=120.0, cpu_s=1) as pool:
        result = pool.run_one(hostile("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                                      "while True:\n    pass"))
    assert result.outcome is Outcome.TIMEOUT
    assert "cpu_s=1" in result.detail and result.seconds < 120.0


def test_a_program_sees_no_file_descriptor_of_its_parent(tmp_path):
    kept_open = open(tmp_path / "parent_file", "w")  # noqa: SIM115 - held open on purpose while the sandbox runs
    try:
        program = "import os\nprint('FDS', sorted(int(f) for f in os.listdir('/proc/self/fd')))\n" + ADD
        with sandbox_pool(workers=1) as pool:
            result = pool.run_one(Execution(program, TEST, "add"))
    finally:
        kept_open.close()
    assert result.outcome is Outcome.PASSED
    fds = eval(result.output_tail.split("FDS ", 1)[1].splitlines()[0])  # a list of ints printed by the program
    assert len(fds) <= 5, fds  # stdin, stdout, stderr, the verdict, listdir's own
