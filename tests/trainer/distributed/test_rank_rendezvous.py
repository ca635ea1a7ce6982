"""Where a multi-rank trainer's ranks meet (services/trainer/distributed/rank_rendezvous.py), over real gRPC and real
sockets in one process: a rank reads rank 0's spec from a fresh store and refuses the store of a group it
already joined; a rank with another token is refused at once and writes nothing; a closed liveness
connection reports the lost rank at once on either end, and nothing once the group is closing; a stranger
at the liveness socket neither takes a rank's place nor ends the group; the rank entry point names a bad
flag and a missing token."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV, BearerToken, generate_token
from services.common.process.ports import free_port
from services.trainer.distributed.rank_rendezvous import (LivenessHub, LivenessLink, RendezvousRefused, join_store,
                                              liveness_proof, serve_store)
from services.trainer.distributed.rank_rendezvous import _hang_up as hang_up

REPO = Path(__file__).resolve().parents[3]
TOKEN = BearerToken(generate_token())


def test_a_rank_reads_the_spec_of_a_fresh_store_and_refuses_one_it_joined_before():
    address = f"127.0.0.1:{free_port()}"
    rank0 = serve_store(address, 2, {"world_size": 2, "device": "cpu"}, TOKEN, timeout_s=10)
    try:
        rank1, spec = join_store(address, 1, TOKEN, timeout_s=10)
        assert spec == {"world_size": 2, "device": "cpu"}
        # Rank 1 again, as after a restart that reached the old rank 0 before it exited: not this store.
        with pytest.raises(TimeoutError, match="formed before this rank's previous start"):
            join_store(address, 1, TOKEN, timeout_s=1.5)
        assert rank0.store.add("joined/1", 0) >= 2  # it asked, and let go
        rank1.close()
    finally:
        rank0.close()


def test_a_rank_with_another_token_is_refused_at_once_and_writes_nothing():
    address = f"127.0.0.1:{free_port()}"
    rank0 = serve_store(address, 2, {"world_size": 2}, TOKEN, timeout_s=10)
    try:
        keys = rank0.base.num_keys()
        # A join timeout of 10 minutes: the refusal is final, the rank does not wait it out.
        with pytest.raises(RendezvousRefused, match="refused this rank's token .*UNAUTHENTICATED"):
            join_store(address, 1, BearerToken(generate_token()), timeout_s=600)
        assert rank0.base.num_keys() == keys and not rank0.base.check(["trainer/joined/1"])
        rank1, spec = join_store(address, 1, TOKEN, timeout_s=10)  # the slot is still rank 1's
        assert spec == {"world_size": 2}
        rank1.close()
    finally:
        rank0.close()


def _links_up(hub: LivenessHub, ranks: list[int], on_lost) -> list[LivenessLink]:
    return [LivenessLink(hub.published(), r, TOKEN, on_lost, timeout_s=10) for r in ranks]


def test_a_closed_liveness_connection_reports_the_lost_rank_on_either_end():
    lost_at_0, lost_at_1, lost_at_2 = [], [], []  # rank 2's own report is moot: it is the one that died
    events = [threading.Event() for _ in range(3)]

    def recorder(out, event):
        return lambda who: (out.append(who), event.set())

    hub = LivenessHub("127.0.0.1", 3, recorder(lost_at_0, events[0]), TOKEN)
    link1 = LivenessLink(hub.published(), 1, TOKEN, recorder(lost_at_1, events[1]), timeout_s=10)
    link2 = LivenessLink(hub.published(), 2, TOKEN, recorder(lost_at_2, events[2]), timeout_s=10)
    hub.accept_all(timeout_s=10)
    hang_up(link2._conn)  # what the kernel does for a process that died
    assert events[0].wait(10) and lost_at_0 == ["rank 2"]
    hang_up(hub._conns[1])  # rank 0 gone, as rank 1 sees it
    assert events[1].wait(10) and lost_at_1 == ["rank 0"]
    link1.close()


def test_a_closing_group_reports_no_loss():
    lost = []
    hub = LivenessHub("127.0.0.1", 2, lost.append, TOKEN)
    [link] = _links_up(hub, [1], lost.append)
    hub.accept_all(timeout_s=10)
    hub.closing.set()  # GroupTrainer.close, before it tells the ranks to stop
    link.close()  # the rank leaves its loop
    hub.close()
    watcher = [t for t in threading.enumerate() if t.name == "trainer-rank-liveness"]
    for t in watcher:
        t.join(timeout=10)
    assert lost == []


def test_a_stranger_at_the_liveness_socket_neither_takes_a_rank_nor_ends_the_group():
    lost, lost_event = [], threading.Event()
    hub = LivenessHub("127.0.0.1", 3, lambda who: (lost.append(who), lost_event.set()), TOKEN)
    host, port = hub.address.rsplit(":", 1)

    def stranger(line: bytes | None) -> socket.socket:
        conn = socket.create_connection((host, int(port)), timeout=10)
        if line is not None:
            conn.sendall(line)
        return conn

    accepting = threading.Thread(target=hub.accept_all, args=(60,))
    accepting.start()
    other = BearerToken(generate_token())
    strangers = [
        stranger(None),  # connects and says nothing: must not hold up the ranks behind it
        stranger(b"1\n"),  # the old protocol: a rank number alone
        stranger(b"not a rank\n"),
        stranger(f"1 {liveness_proof(other, hub.nonce, 1)}\n".encode()),  # another deployment's token
        stranger(f"1 {liveness_proof(TOKEN, 'an-older-group', 1)}\n".encode()),  # a proof of another group
        stranger(f"7 {liveness_proof(TOKEN, hub.nonce, 7)}\n".encode()),  # no such rank
        stranger(b"x" * 4096),  # no line at all
    ]
    hang_up(stranger(None))  # connects and hangs up at once
    [link1] = _links_up(hub, [1], lambda who: None)
    deadline = time.monotonic() + 30
    while 1 not in hub._conns and time.monotonic() < deadline:
        time.sleep(0.01)
    # Rank 1's own line, replayed from another connection (as one who saw it on the wire would).
    strangers.append(stranger(f"1 {liveness_proof(TOKEN, hub.nonce, 1)}\n".encode()))
    [link2] = _links_up(hub, [2], lambda who: None)
    accepting.join(timeout=60)
    assert not accepting.is_alive()
    assert sorted(hub._conns) == [1, 2]
    assert hub._conns[1].getpeername() == link1._conn.getsockname()
    assert hub._conns[2].getpeername() == link2._conn.getsockname()
    for conn in strangers:  # every stranger hangs up: the group does not notice
        hang_up(conn)
    hang_up(link2._conn)  # a real rank does
    assert lost_event.wait(10) and lost == ["rank 2"]
    hub.closing.set()
    link1.close()
    hub.close()


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0", "--rendezvous", "127.0.0.1:29400"], "rank"),
    (["--rank", "1", "--rendezvous", "no-port"], "rendezvous"),
])
def test_the_rank_entry_point_names_a_bad_flag(argv, message):
    out = subprocess.run([sys.executable, "-m", "services.trainer.distributed.rank", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and f"configuration error: {message}" in out.stderr, out.stderr


def test_the_rank_entry_point_does_not_start_without_a_token():
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    out = subprocess.run([sys.executable, "-m", "services.trainer.distributed.rank", "--rank", "1", "--rendezvous",
                          f"127.0.0.1:{free_port()}"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "configuration error: no authentication token" in out.stderr, out.stderr


def test_a_rank_imports_no_module_the_store_names_unless_started_allowing_it():
    from services.trainer.distributed.worker_group import GroupSpec, run_rank

    address = f"127.0.0.1:{free_port()}"
    spec = GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=10, rendezvous=address,
                     attention_plugins=("tests.support.boundary_blind_plugin",))
    rank0 = serve_store(address, 2, spec.as_dict(), TOKEN, timeout_s=10)
    try:
        with pytest.raises(ValueError, match=r"attention_plugins: .*boundary_blind_plugin.* not started with"):
            run_rank(1, address, TOKEN, join_timeout_s=10, allowed_plugins=("other.module",))
        assert "tests.support.boundary_blind_plugin" not in sys.modules
    finally:
        rank0.close()
