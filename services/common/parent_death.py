"""Child processes that do not outlive the process that started them.

PR_SET_PDEATHSIG makes the kernel signal the child when the thread that
forked it exits, which covers the parent being SIGKILLed, when no cleanup
code of ours runs. (It is the forking *thread*: start children from a thread
that lives as long as they should.) Linux only; elsewhere a no-op.
"""
from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
# Looked up here, in the parent: between fork and exec in a multi-threaded
# process the child should do as little as possible (no dlopen, no imports).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(sig: int) -> Callable[[], None]:
    """A subprocess.Popen preexec_fn: `sig` reaches the child when its parent thread dies."""
    def set_parent_death_signal() -> None:  # runs in the child between fork and exec
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(sig))

    return set_parent_death_signal
