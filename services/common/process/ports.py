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
parts of that range, so two of them never hand out the same port. Slices
nest ("0/4,1/2": the second half of the first quarter).

A process draws from the first half of its range only; the processes it
starts get the second half (child_port_slice). A port handed out here waits
unbound until the child it is meant for starts up, and a child picking a port
of its own meanwhile (the coordinator's embedded Redis, a trainer group's
rendezvous) must not take it: the two never draw from the same ports.
"""
from __future__ import annotations

import os
import random
import socket
import threading
from collections.abc import Mapping
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
    """[low, high) cut to this process's part under LOCKSTEP_PORT_SLICE=i/n[,j/m...] (0 <= i < n), each slice
    taken of the one before it."""
    value = os.environ.get(SLICE_ENV, "")
    for part in value.split(",") if value else ():
        try:
            index, count = (int(x) for x in part.split("/"))
        except ValueError:
            raise ValueError(f"{SLICE_ENV}: {value!r}: {part!r} is not i/n") from None
        if not 0 <= index < count:
            raise ValueError(f"{SLICE_ENV}: {value!r}: i must be in [0, n)")
        width = (high - low) // count
        low, high = low + index * width, low + (index + 1) * width
    return low, high


def child_port_slice(env: Mapping[str, str] | None = None) -> str:
    """LOCKSTEP_PORT_SLICE for the processes started from `env` (default: this process's environment): the
    half of its range that a process of that environment never draws from."""
    value = (os.environ if env is None else env).get(SLICE_ENV, "")
    return f"{value},1/2" if value else "1/2"


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
    high = low + (high - low) // 2  # the other half is this process's children's (child_port_slice)
    with _lock:
        if high - low >= 200 + n:
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
