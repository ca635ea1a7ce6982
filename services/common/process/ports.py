"""Pick a port for a server that another process will bind a moment later.

Binding port 0 and closing again hands out a port from the kernel's ephemeral
range, the same range the kernel draws from for the source port of every
outgoing connection: in the gap before the server binds, any client on the
machine can take it ("Address already in use" in a CI run). The ports handed
out here come from below that range (and above Ray's worker ports,
10002-19999), which the kernel never assigns on its own; each is checked
bindable, and one process never hands out the same port twice.

Processes that pick ports side by side (a test runner's parallel workers)
set LOCKSTEP_PORT_SLICE=i/n: each then draws only from the i-th of n equal
parts of that range, so two of them never hand out the same port.
"""
from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

_LOW = 20000
SLICE_ENV = "LOCKSTEP_PORT_SLICE"
_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()  # not the global RNG: tests seed that one


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _sliced(low: int, high: int) -> tuple[int, int]:
    """[low, high) cut to this process's part under LOCKSTEP_PORT_SLICE=i/n (0 <= i < n)."""
    value = os.environ.get(SLICE_ENV, "")
    if not value:
        return low, high
    try:
        index, count = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"{SLICE_ENV}: {value!r} is not i/n") from None
    if not 0 <= index < count:
        raise ValueError(f"{SLICE_ENV}: {value!r}: i must be in [0, n)")
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    return free_port_run(1, host)


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """A port p with p .. p+n-1 all free (for services numbered from a base port)."""
    low, high = _sliced(_LOW, _ephemeral_low())
    with _lock:
        if high - low >= 1000 + n:
            for _ in range(200):
                base = _rng.randrange(low, high - n)
                run = range(base, base + n)
                if not _handed_out.intersection(run) and all(_bindable(host, p) for p in run):
                    _handed_out.update(run)
                    return base
        # No room below the ephemeral range (or not Linux): the kernel's pick, then its neighbours.
        for _ in range(200):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                base = int(s.getsockname()[1])
            run = range(base, base + n)
            if base + n <= 65536 and not _handed_out.intersection(run) and all(_bindable(host, p) for p in run):
                _handed_out.update(run)
                return base
    raise RuntimeError(f"no {n} consecutive free ports on {host}")
