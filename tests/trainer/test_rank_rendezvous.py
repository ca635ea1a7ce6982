"""Where a multi-rank trainer's ranks meet (services/trainer/rank_rendezvous.py), over real sockets in one
process: a rank reads rank 0's spec from a fresh store and refuses the store of a group it already joined;
a closed liveness connection reports the lost rank at once on either end, and nothing once the group is
closing; the rank entry point names a bad flag."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.common.ports import free_port
from services.trainer.rank_rendezvous import LivenessHub, LivenessLink, join_store, serve_store
from services.trainer.rank_rendezvous import _hang_up as hang_up

REPO = Path(__file__).resolve().parents[2]


def test_a_rank_reads_the_spec_of_a_fresh_store_and_refuses_one_it_joined_before():
    address = f"127.0.0.1:{free_port()}"
    store = serve_store(address, 2, {"world_size": 2, "device": "cpu"}, timeout_s=10)
    client, spec = join_store(address, 1, timeout_s=10)
    assert spec == {"world_size": 2, "device": "cpu"}
    # Rank 1 again, as after a restart that reached the old rank 0 before it exited: not this store.
    with pytest.raises(TimeoutError, match="formed before this rank's previous start"):
        join_store(address, 1, timeout_s=1.5)
    assert store.add("joined/1", 0) >= 2  # it asked, and let go
    del client, store


def test_a_closed_liveness_connection_reports_the_lost_rank_on_either_end():
    lost_at_0, lost_at_1, lost_at_2 = [], [], []  # rank 2's own report is moot: it is the one that died
    events = [threading.Event() for _ in range(3)]

    def recorder(out, event):
        return lambda who: (out.append(who), event.set())

    hub = LivenessHub("127.0.0.1", 3, recorder(lost_at_0, events[0]))
    link1 = LivenessLink(hub.address, 1, recorder(lost_at_1, events[1]), timeout_s=10)
    link2 = LivenessLink(hub.address, 2, recorder(lost_at_2, events[2]), timeout_s=10)
    hub.accept_all(timeout_s=10)
    hang_up(link2._conn)  # what the kernel does for a process that died
    assert events[0].wait(10) and lost_at_0 == ["rank 2"]
    hang_up(hub._conns[1])  # rank 0 gone, as rank 1 sees it
    assert events[1].wait(10) and lost_at_1 == ["rank 0"]
    link1.close()


def test_a_closing_group_reports_no_loss():
    lost = []
    hub = LivenessHub("127.0.0.1", 2, lost.append)
    link = LivenessLink(hub.address, 1, lost.append, timeout_s=10)
    hub.accept_all(timeout_s=10)
    hub.closing.set()  # GroupTrainer.close, before it tells the ranks to stop
    link.close()  # the rank leaves its loop
    hub.close()
    watcher = [t for t in threading.enumerate() if t.name == "trainer-rank-liveness"]
    for t in watcher:
        t.join(timeout=10)
    assert lost == []


@pytest.mark.parametrize("argv, message", [
    (["--rank", "0", "--rendezvous", "127.0.0.1:29400"], "rank"),
    (["--rank", "1", "--rendezvous", "no-port"], "rendezvous"),
])
def test_the_rank_entry_point_names_a_bad_flag(argv, message):
    out = subprocess.run([sys.executable, "-m", "services.trainer.rank", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode != 0 and f"configuration error: {message}" in out.stderr, out.stderr


def test_a_rank_imports_no_module_the_store_names_unless_started_allowing_it():
    from services.trainer.worker_group import GroupSpec, run_rank

    address = f"127.0.0.1:{free_port()}"
    spec = GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=10, rendezvous=address,
                     attention_plugins=("tests.support.boundary_blind_plugin",))
    store = serve_store(address, 2, spec.as_dict(), timeout_s=10)
    with pytest.raises(ValueError, match=r"attention_plugins: .*boundary_blind_plugin.* not started with"):
        run_rank(1, address, join_timeout_s=10, allowed_plugins=("other.module",))
    assert "tests.support.boundary_blind_plugin" not in sys.modules
    del store
