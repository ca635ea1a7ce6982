"""Child processes that do not outlive the process that started them.

PR_SET_PDEATHSIG makes the kernel signal the child when the thread that
forked it exits, which covers the parent being SIGKILLed, when no cleanup
code of ours runs. (It is the forking *thread*: start children from a thread
that lives as long as they should.) Linux only; elsewhere the command runs as
given.

The signal is set by the child itself, after exec: `with_parent_death` wraps a
command in a small Python launcher that calls prctl, checks that its parent is
still the process that started it (the parent may have died before prctl ran),
then execs the command in its own place (same pid). A `preexec_fn` would run
Python code between fork and exec, which is unsafe in a multi-threaded parent:
the coordinator (gRPC and Redis client threads) and the Ray actors are, and
such children were seen to crash with SIGSEGV before exec.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# argv: [python, -I, -S, -c, LAUNCHER, signal, parent pid, program, args...]
LAUNCHER = (
    "import ctypes, os, sys\n"
    "sig, parent = int(sys.argv[1]), int(sys.argv[2])\n"
    "if ctypes.CDLL(None, use_errno=True).prctl(1, sig) != 0:\n"  # 1: PR_SET_PDEATHSIG
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed: errno %d' % ctypes.get_errno())\n"
    "if os.getppid() != parent:\n"
    "    os.kill(os.getpid(), sig)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)
LAUNCHER_ARGS = 7
"""How many argv elements precede the wrapped command."""


def with_parent_death(argv: Sequence[str], sig: int) -> list[str]:
    """`argv`, run so that `sig` reaches it when the calling thread dies (Linux; elsewhere `argv` unchanged)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", LAUNCHER, str(int(sig)), str(os.getpid()), *map(str, argv)]


def wrapped_command(argv: Sequence[str]) -> list[str]:
    """The command `with_parent_death` wrapped, or `argv` itself when it is not wrapped."""
    args = list(argv)
    if len(args) > LAUNCHER_ARGS and args[1:5] == ["-I", "-S", "-c", LAUNCHER]:
        return args[LAUNCHER_ARGS:]
    return args
