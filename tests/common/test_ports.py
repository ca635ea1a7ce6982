"""free_port: ports the kernel would not hand to an outgoing connection, each once per process."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from services.common.process.ports import child_port_slice, free_port, free_port_run


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


def test_a_process_and_the_processes_it_starts_never_draw_the_same_ports(monkeypatch):
    """A parent draws from the first half of its slice, its children from the second (child_port_slice), so a
    port the parent handed out for a child and not yet bound is never a sibling's pick meanwhile."""
    low = ephemeral_low_or_skip()
    width = (low - 20000) // 3
    part = range(20000 + width, 20000 + 2 * width)
    monkeypatch.setenv("LOCKSTEP_PORT_SLICE", "1/3")
    parent = [free_port() for _ in range(60)]
    child_env = child_port_slice()
    assert child_env == "1/3,1/2"
    monkeypatch.setenv("LOCKSTEP_PORT_SLICE", child_env)
    child = [free_port() for _ in range(60)]
    grandchild_env = child_port_slice()
    monkeypatch.setenv("LOCKSTEP_PORT_SLICE", grandchild_env)
    grandchild = [free_port() for _ in range(30)]
    assert all(p in part for p in parent + child + grandchild)
    half, quarter = width // 2, width // 2 // 2
    assert max(parent) < part.start + half <= min(child)
    assert max(child) < part.start + half + quarter <= min(grandchild)


@pytest.mark.parametrize("value", ["2/2", "one/2", "1", "-1/2", "0/2,3/2", "0/2,"])
def test_a_malformed_port_slice_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("LOCKSTEP_PORT_SLICE", value)
    with pytest.raises(ValueError, match="LOCKSTEP_PORT_SLICE"):
        free_port()
