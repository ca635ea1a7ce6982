"""Where the ranks of a multi-rank trainer meet, and how each learns that the group lost a rank.

Rank 0 serves a rendezvous (services/common/rendezvous/service.py: a KeyTable over gRPC) at its
`rendezvous` address, host:port, bound to that host only; it reads and writes the table in process
(LocalStore). Ranks 1..N-1 dial that address, wherever they run (processes rank 0 started on its host,
or Ray actors on other nodes), through a RendezvousClient: every operation is a gRPC call carrying the
deployment's bearer token, and a call without it is answered UNAUTHENTICATED before its message is read.
A rank whose token is not the deployment's is told so at its first call and stops there
(`RendezvousRefused`, naming the reason): it never reads the spec, let alone joins the process group.
Ranks that rank 0 starts itself get the token rank 0 holds (a fresh one for the group when the trainer
was built without one). Every key lives in the table's one open group, GROUP; the process group itself
meets under the same prefix. The table holds what the ranks must agree on before the process group forms:

- `spec`: the group's GroupSpec as rank 0 has it (world size, device kind, threads, collective
  timeout, plugins), so a rank started elsewhere runs exactly what rank 0 runs;
- `joined/<r>`: a counter each rank r adds 1 to. A fresh store answers 1. More means rank r already
  joined this store once: a rank restarted after a loss has reached the previous rank 0's store before
  that rank 0 noticed the loss and exited. The rank lets go and asks again until a fresh store answers;
- `liveness`: host:port of rank 0's liveness socket and the nonce of this group (JSON).

Liveness: every rank keeps one TCP connection to rank 0's liveness socket for the group's lifetime. The
kernel closes a process's sockets when it dies (SIGKILL, OOM), so the other end reads EOF at once: rank 0
learns that a rank is gone even while no collective is running, and every rank learns that rank 0 is
gone. Either way the process exits (`on_lost`), which is the group failing closed: the supervisors
restart every rank, they meet at the new rank 0's fresh store, and the coordinator resumes the run from
its last checkpoint. A node that vanishes without closing its sockets is caught by the collective timeout.

The liveness socket is a plain TCP port, so what reaches it is checked before it counts: a rank's first
line is its rank and a proof, HMAC-SHA256 under the deployment's token of the group's nonce and that
rank (`liveness_proof`); the nonce is fresh at every start of rank 0 and readable only through the
authenticated store. Rank 0 takes a connection as rank r only with rank r's proof, once per rank, and
drops any other connection (bad proof, unknown or repeated rank, no line within HANDSHAKE_TIMEOUT_S)
without counting it, so a stranger can neither take a rank's place nor, by hanging up, make rank 0
exit; the socket stops listening once every rank is in. A proof seen on the wire is worth nothing
later: it names one rank of one group, and that rank holds its place already. (The token itself
travels in clear over the gRPC channel, as every Lockstep gRPC call does: keep the ports on the cluster
network, see docs/security.md.)

A rank imports only the plugin modules it was started allowing, whatever the spec names.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from services.common.auth import BearerToken
from services.common.process.service_config import split_host_port
from services.common.rendezvous.key_table import KeyTable, RendezvousError, RendezvousLimits, Unauthenticated
from services.common.rendezvous.service import RendezvousServer
from services.common.rendezvous.store import BlockingStore, LocalStore, RendezvousClient

log = logging.getLogger("lockstep.trainer.rendezvous")
GROUP = "trainer"  # the one open group of the ranks' KeyTable: every key below is under "trainer/"
SPEC_KEY, LIVENESS_KEY = "spec", "liveness"
RETRY_S = 0.5  # pause before a rank asks a store again (a stale one, or none yet)
HANDSHAKE_TIMEOUT_S = 10.0  # a connection to the liveness socket that sends no proof this long is dropped
MAX_HANDSHAKE_BYTES = 128  # "<rank> <64 hex digits>\n" fits with room; a longer first line is dropped
MAX_PENDING = 64  # connections awaiting their proof at once; past it the oldest is dropped (bounds the fds)


class RendezvousRefused(PermissionError):
    """Rank 0's rendezvous refused this rank's token: it must not wait and ask again."""


def split_address(address: str) -> tuple[str, int]:
    return split_host_port(address, "rendezvous")


@dataclass
class RankStore:
    """The ranks' store as one rank holds it. `store` is what the ranks and their process group use (keys
    under GROUP); `base` is the Python store under it, kept here because a process group built on a Python
    store does not keep it alive; `server` is rank 0's gRPC rendezvous (None on the other ranks)."""

    store: dist.Store
    base: BlockingStore
    server: RendezvousServer | None = None
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.stop(grace_s=0)
        if isinstance(self.base, RendezvousClient):
            self.base.close()


def serve_store(address: str, world_size: int, spec: dict, token: BearerToken, timeout_s: float) -> RankStore:
    """Rank 0's rendezvous at `address` (that host only), for callers holding `token`, holding `spec`;
    a port in use fails here, naming it."""
    split_address(address)
    table = KeyTable(RendezvousLimits())
    table.open_group(GROUP)
    server = RendezvousServer(table, token, address, field="rendezvous")
    server.start()  # OSError naming the address when it cannot listen there
    base = LocalStore(table, timeout_s)
    ranks = RankStore(dist.PrefixStore(GROUP, base), base, server)
    ranks.store.set(SPEC_KEY, json.dumps(spec))
    ranks.store.add("joined/0", 1)
    return ranks


def join_store(address: str, rank: int, token: BearerToken, timeout_s: float) -> tuple[RankStore, dict]:
    """Rank `rank`'s connection to a fresh store of rank 0 at `address`, and the spec it holds. Waits
    (within `timeout_s`) for rank 0 to serve one; a store this rank already joined is let go (see module).
    A store that refuses `token` raises RendezvousRefused at once."""
    split_address(address)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        base = RendezvousClient(address, token, max(deadline - time.monotonic(), 1.0))
        ranks = RankStore(dist.PrefixStore(GROUP, base), base)
        try:
            if ranks.store.add(f"joined/{rank}", 1) == 1:
                return ranks, json.loads(ranks.store.get(SPEC_KEY))
            last = "the store there was formed before this rank's previous start"
        except Unauthenticated as exc:
            ranks.close()
            raise RendezvousRefused(f"rendezvous: rank 0 at {address} refused this rank's token ({exc}); "
                                    "start the rank with the deployment's token (auth_token_file, "
                                    "$LOCKSTEP_AUTH_TOKEN_FILE or $LOCKSTEP_AUTH_TOKEN)") from None
        except (RuntimeError, OSError) as exc:  # rank 0 not up yet, or gone while we asked
            last = str(exc)
        ranks.close()
        time.sleep(RETRY_S)
    raise TimeoutError(f"rendezvous: no fresh trainer group at {address} within {timeout_s:g} s ({last})")


def liveness_proof(token: BearerToken, nonce: str, rank: int) -> str:
    """What rank `rank` sends first on its liveness connection to the group of `nonce` (see module)."""
    message = f"lockstep trainer liveness/{nonce}/{rank}".encode()
    return hmac.new(token.secret.encode(), message, hashlib.sha256).hexdigest()


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
    """Rank 0's end: takes one proven connection per other rank; EOF on any calls `on_lost('rank r')`."""

    def __init__(self, host: str, world_size: int, on_lost: Callable[[str], None], token: BearerToken) -> None:
        self.world_size, self.on_lost, self._token = world_size, on_lost, token
        self.nonce = secrets.token_hex(16)
        self.closing = threading.Event()
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._conns: dict[int, socket.socket] = {}

    def published(self) -> str:
        """The value of LIVENESS_KEY: where the ranks connect and the nonce their proofs name."""
        return json.dumps({"address": self.address, "nonce": self.nonce})

    def accept_all(self, timeout_s: float) -> None:
        """Wait (within `timeout_s`) until every other rank has connected with its proof; connections
        without one are dropped as they fail. Then stop listening and watch the ranks' connections."""
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        self._server.setblocking(False)
        sel.register(self._server, selectors.EVENT_READ)
        pending: dict[socket.socket, tuple[bytearray, float, str]] = {}  # conn -> (read so far, deadline, peer)
        try:
            while len(self._conns) < self.world_size - 1:
                now = time.monotonic()
                for conn, (_, until, peer) in list(pending.items()):
                    if now >= until:
                        self._drop(sel, pending, conn, peer, f"no proof within {HANDSHAKE_TIMEOUT_S:g} s")
                if now >= deadline:
                    missing = sorted(set(range(1, self.world_size)) - set(self._conns))
                    raise TimeoutError(f"rendezvous: ranks {missing} did not connect to the liveness socket "
                                       f"within {timeout_s:g} s")
                waits = [deadline, *(until for _, until, _ in pending.values())]
                for key, _ in sel.select(max(min(waits) - now, 0.0)):
                    if key.fileobj is self._server:
                        self._accept(sel, pending)
                    else:
                        self._read_proof(sel, pending, key.fileobj)
        finally:
            for conn, (_, _, peer) in list(pending.items()):
                self._drop(sel, pending, conn, peer, "the group formed without it")
            sel.close()
            self._server.close()
        watched = selectors.DefaultSelector()  # filled here: a close() right after this finds them watched
        for rank, conn in self._conns.items():
            watched.register(conn, selectors.EVENT_READ, rank)
        threading.Thread(target=self._watch, args=(watched,), name="trainer-rank-liveness", daemon=True).start()

    def _accept(self, sel: selectors.BaseSelector, pending: dict) -> None:
        try:
            conn, peer = self._server.accept()
        except OSError:  # none after all, or out of file descriptors: the pending ones are dropped in time
            return
        if len(pending) >= MAX_PENDING:
            oldest = min(pending, key=lambda c: pending[c][1])
            self._drop(sel, pending, oldest, pending[oldest][2],
                       f"more than {MAX_PENDING} connections awaiting their proof")
        conn.setblocking(False)
        pending[conn] = (bytearray(), time.monotonic() + HANDSHAKE_TIMEOUT_S, f"{peer[0]}:{peer[1]}")
        sel.register(conn, selectors.EVENT_READ)

    def _read_proof(self, sel: selectors.BaseSelector, pending: dict, conn: socket.socket) -> None:
        got, _, peer = pending[conn]
        try:
            data = conn.recv(MAX_HANDSHAKE_BYTES + 1 - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(sel, pending, conn, peer, "it hung up before its proof")
            return
        got += data
        if b"\n" not in got:
            if len(got) > MAX_HANDSHAKE_BYTES:
                self._drop(sel, pending, conn, peer, f"no line within {MAX_HANDSHAKE_BYTES} bytes")
            return
        rank, why = self._proven_rank(bytes(got.split(b"\n", 1)[0]))
        if rank is None:
            self._drop(sel, pending, conn, peer, why)
            return
        sel.unregister(conn)
        del pending[conn]
        conn.setblocking(True)
        self._conns[rank] = conn

    def _proven_rank(self, line: bytes) -> tuple[int | None, str]:
        """The rank `line` ("<rank> <proof>") proves, or None and why not."""
        parts = line.split(b" ")
        if len(parts) != 2 or not parts[0].isdigit():
            return None, "its first line is not '<rank> <proof>'"
        rank = int(parts[0])
        if not 1 <= rank < self.world_size:
            return None, f"rank {rank} is not a worker rank of a group of {self.world_size}"
        expected = liveness_proof(self._token, self.nonce, rank).encode()
        if not hmac.compare_digest(parts[1], expected):
            return None, f"its proof for rank {rank} is not this group's (wrong token or an older group)"
        if rank in self._conns:
            return None, f"rank {rank} is connected already"
        return rank, ""

    @staticmethod
    def _drop(sel: selectors.BaseSelector, pending: dict, conn: socket.socket, peer: str, why: str) -> None:
        log.warning("liveness: dropped a connection from %s: %s", peer, why)
        sel.unregister(conn)
        del pending[conn]
        _hang_up(conn)

    def _watch(self, sel: selectors.BaseSelector) -> None:
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
    """A rank's end: one connection to rank 0's hub, opened with this rank's proof; EOF calls
    `on_lost('rank 0')`. `published` is the LIVENESS_KEY value rank 0's store holds."""

    def __init__(self, published: str, rank: int, token: BearerToken, on_lost: Callable[[str], None],
                 timeout_s: float) -> None:
        try:
            hub = json.loads(published)
            address, nonce = str(hub["address"]), str(hub["nonce"])
        except (ValueError, TypeError, KeyError):
            raise RendezvousError(f"rendezvous: {LIVENESS_KEY!r} holds no address and nonce") from None
        self.closing = threading.Event()
        self._conn = socket.create_connection(split_address(address), timeout=timeout_s)
        self._conn.sendall(f"{rank} {liveness_proof(token, nonce, rank)}\n".encode())
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
