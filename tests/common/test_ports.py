"""free_port: ports the kernel would not hand to an outgoing connection, each once per process."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.process.ports import free_port, free_port_run


def ephemeral_low_or_skip() -> int:
    """The kernel's lowest ephemeral port, the top of free_port's range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4/ip_local_port_range (not Linux): free_port falls back to the kernel's pick")


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    low = ephemeral_low_or_skip()
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


def test_a_port_slice_keeps_each_process_to_its_own_part_of_the_range(monkeypatch):
    low = ephemeral_low_or_skip()
    width = (low - 20000) // 3
    for index in range(3):
        monkeypatch.setenv("LOCKSTEP_PORT_SLICE", f"{index}/3")
        ports = [free_port() for _ in range(30)]
        part = range(20000 + index * width, 20000 + (index + 1) * width)
        assert all(p in part for p in ports), (index, ports)


@pytest.mark.parametrize("value", ["2/2", "one/2", "1", "-1/2"])
def test_a_malformed_port_slice_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("LOCKSTEP_PORT_SLICE", value)
    with pytest.raises(ValueError, match="LOCKSTEP_PORT_SLICE"):
        free_port()
