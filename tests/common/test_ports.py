"""free_port: ports the kernel would not hand to an outgoing connection, each once per process."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.ports import free_port, free_port_run


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux): free_port falls back to the kernel's pick")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(20000 <= p < low for p in ports), ports
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_never_handed_out():
    taken = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert not held & {free_port() for _ in range(200)}
    finally:
        for s in taken:
            s.close()


def test_a_run_of_ports_is_free_as_a_whole_and_not_handed_out_again():
    base = free_port_run(5)
    for p in range(base, base + 5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    assert not set(range(base, base + 5)) & {free_port() for _ in range(100)}
