"""Pick a port for a server that another process will bind a moment later.

Binding port 0 and closing again hands out a port from the kernel's ephemeral
range, the same range the kernel draws from for the source port of every
outgoing connection: in the gap before the server binds, any client on the
machine can take it ("Address already in use" in a CI run). The ports handed
out here come from below that range (and above Ray's worker ports,
10002-19999), which the kernel never assigns on its own; each is checked
bindable, and one process never hands out the same port twice.
"""
from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_LOW = 20000
_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()  # not the global RNG: tests seed that one


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    high = _ephemeral_low()
    with _lock:
        if high - _LOW >= 1000:
            for _ in range(200):
                port = _rng.randrange(_LOW, high)
                if port not in _handed_out and _bindable(host, port):
                    _handed_out.add(port)
                    return port
        # No room below the ephemeral range (or not Linux): the kernel's pick.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        _handed_out.add(port)
        return port
