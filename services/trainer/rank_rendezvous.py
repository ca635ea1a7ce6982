"""Where the ranks of a multi-rank trainer meet, and how each learns that the group lost a rank.

Rank 0 serves a torch TCPStore on the port of its `rendezvous` address (host:port; torch listens on every
interface of the host) and ranks 1..N-1 dial that address,
wherever they run (processes rank 0 started on its host, or Ray actors on other nodes). The store holds
what the ranks must agree on before the process group forms:

- `spec`: the group's GroupSpec as rank 0 has it (world size, device kind, threads, collective
  timeout, plugins), so a rank started elsewhere runs exactly what rank 0 runs;
- `joined/<r>`: a counter each rank r adds 1 to. A fresh store answers 1. More means rank r already
  joined this store once: a rank restarted after a loss has reached the previous rank 0's store before
  that rank 0 noticed the loss and exited. The rank lets go and asks again until a fresh store answers;
- `liveness`: host:port of rank 0's liveness socket.

Liveness: every rank keeps one TCP connection to rank 0's liveness socket for the group's lifetime. The
kernel closes a process's sockets when it dies (SIGKILL, OOM), so the other end reads EOF at once: rank 0
learns that a rank is gone even while no collective is running, and every rank learns that rank 0 is
gone. Either way the process exits (`on_lost`), which is the group failing closed: the supervisors
restart every rank, they meet at the new rank 0's fresh store, and the coordinator resumes the run from
its last checkpoint. A node that vanishes without closing its sockets is caught by the collective timeout.

Nothing here is authenticated (as torch's own rendezvous stores are not): keep the port on the cluster
network. A rank imports only the plugin modules it was started allowing, whatever the spec names.
"""
from __future__ import annotations

import datetime
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from services.common.service_config import split_host_port

log = logging.getLogger("lockstep.trainer.rendezvous")
SPEC_KEY, LIVENESS_KEY = "spec", "liveness"
RETRY_S = 0.5  # pause before a rank asks a store again (a stale one, or none yet)


def split_address(address: str) -> tuple[str, int]:
    return split_host_port(address, "rendezvous")


def serve_store(address: str, world_size: int, spec: dict, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store at `address`, holding `spec`; a port in use fails here, naming it."""
    host, port = split_address(address)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise OSError(f"rendezvous: cannot serve the ranks' store at {address}: {exc}") from None
    store.set(SPEC_KEY, json.dumps(spec))
    store.add("joined/0", 1)
    return store


def join_store(address: str, rank: int, timeout_s: float) -> tuple[dist.TCPStore, dict]:
    """Rank `rank`'s connection to a fresh store of rank 0 at `address`, and the spec it holds. Waits
    (within `timeout_s`) for rank 0 to serve one; a store this rank already joined is let go (see module)."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        left = max(deadline - time.monotonic(), 1.0)
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=left))
            if store.add(f"joined/{rank}", 1) == 1:
                return store, json.loads(store.get(SPEC_KEY))
            last = "the store there was formed before this rank's previous start"
        except (RuntimeError, OSError) as exc:  # rank 0 not up yet, or gone while we asked
            last = str(exc)
        time.sleep(RETRY_S)
    raise TimeoutError(f"rendezvous: no fresh trainer group at {address} within {timeout_s:g} s ({last})")


def _hang_up(conn: socket.socket) -> None:
    """Close `conn` so that its peer reads EOF now: a plain close() while this process's watcher thread
    blocks in recv() on it would leave the connection open until that recv returned."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _lost(on_lost: Callable[[str], None], who: str, closing: threading.Event) -> None:
    if not closing.is_set():
        on_lost(who)


class LivenessHub:
    """Rank 0's end: accepts one connection per other rank; EOF on any calls `on_lost('rank r')`."""

    def __init__(self, host: str, world_size: int, on_lost: Callable[[str], None]) -> None:
        self.world_size, self.on_lost = world_size, on_lost
        self.closing = threading.Event()
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._conns: dict[int, socket.socket] = {}

    def accept_all(self, timeout_s: float) -> None:
        self._server.settimeout(timeout_s)
        while len(self._conns) < self.world_size - 1:
            conn, _ = self._server.accept()
            conn.settimeout(timeout_s)
            rank = int(conn.recv(16).split(b"\n", 1)[0])
            conn.settimeout(None)
            self._conns[rank] = conn
        self._server.close()
        threading.Thread(target=self._watch, name="trainer-rank-liveness", daemon=True).start()

    def _watch(self) -> None:
        sel = selectors.DefaultSelector()
        for rank, conn in self._conns.items():
            sel.register(conn, selectors.EVENT_READ, rank)
        while True:
            try:
                ready = sel.select()
            except (OSError, ValueError):  # a connection closed under the selector: only close() does that
                _lost(self.on_lost, "a rank", self.closing)
                return
            for key, _ in ready:
                try:
                    data = key.fileobj.recv(1)
                except OSError:
                    data = b""
                if not data:
                    _lost(self.on_lost, f"rank {key.data}", self.closing)
                    return

    def close(self) -> None:
        self.closing.set()
        for conn in self._conns.values():
            _hang_up(conn)


class LivenessLink:
    """A rank's end: one connection to rank 0's hub; EOF calls `on_lost('rank 0')`."""

    def __init__(self, address: str, rank: int, on_lost: Callable[[str], None], timeout_s: float) -> None:
        self.closing = threading.Event()
        self._conn = socket.create_connection(split_address(address), timeout=timeout_s)
        self._conn.sendall(f"{rank}\n".encode())
        self._conn.settimeout(None)
        threading.Thread(target=self._watch, args=(on_lost,), name="trainer-rank-liveness", daemon=True).start()

    def _watch(self, on_lost: Callable[[str], None]) -> None:
        try:
            data = self._conn.recv(1)
        except OSError:
            data = b""
        if not data:
            _lost(on_lost, "rank 0", self.closing)

    def close(self) -> None:
        self.closing.set()
        _hang_up(self._conn)
