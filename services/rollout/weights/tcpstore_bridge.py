"""torch's TCPStore wire protocol on this host's loopback, in front of the trainer's authenticated rendezvous.

An SGLang server joins a weight-update group the way SGLang does (/init_weights_update_group with a
master address and port): its ranks reach a TCPStore there, and TCPStore's protocol has no credentials.
So the rollout service, which holds the deployment's token, opens a `TcpStoreBridge` for the one sync:
a server of that protocol on 127.0.0.1 (an ephemeral port), that admits only connections from processes
of this service's own user (Linux: the peer socket's owner in /proc/net/tcp) and passes each operation
on a key of the sync's group to the trainer's rendezvous through a RendezvousClient. Nothing else is
forwarded: TCPStore's own bookkeeping key ("init/", counted by clients that know the world size) stays
here, and a key of any other group closes the connection. It lives for one receive_broadcast call.

The protocol, as torch's TCPStore client speaks it (torch/csrc/distributed/c10d/TCPStore.cpp and
TCPStoreBackend.hpp): every request is one QueryType byte and its arguments; strings and byte vectors
are a little-endian uint64 length and the bytes; counts are uint64; integers int64; the client first
sends VALIDATE with a magic number, then PING with a nonce it expects back. A client prefixes every key
of its own with "/".
"""
from __future__ import annotations

import enum
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from services.common.rendezvous.key_table import MAX_KEY_BYTES, add_to
from services.common.rendezvous.service import WAIT_SLICE_S
from services.common.rendezvous.store import BlockingStore

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
VALIDATION_MAGIC = 0x3C85F7CE
USER_KEY_PREFIX = "/"
# A value or a key count larger than these is no SGLang rank's: the connection is closed unread.
MAX_VALUE_BYTES = 16 << 20
MAX_KEYS_PER_QUERY = 4096
# Keys a client keeps for itself (TCPStore's "init/" counter) at most, and how often a wait for one looks.
MAX_LOCAL_KEYS = 16
LOCAL_WAIT_POLL_S = 0.05


class Query(enum.IntEnum):
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13


CHECK_READY, CHECK_NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1


def is_loopback_url(url: str) -> bool:
    """Whether `url`'s host is this host's loopback, where a bridge can be reached."""
    host = urlsplit(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ProtocolError(Exception):
    """The peer sent something this bridge does not serve: its connection is closed."""


def proc_net_endpoint(address: str, port: int, *, ipv6: bool) -> str:
    """An endpoint as /proc/net/tcp (IPv4) or /proc/net/tcp6 (IPv6; an IPv4 address v4-mapped) writes it:
    the address as 32-bit words in host (little-endian) order, then the port."""
    ip = ipaddress.ip_address(address)
    if ipv6 and ip.version == 4:
        ip = ipaddress.IPv6Address(f"::ffff:{ip}")
    packed = ip.packed
    words = "".join(f"{struct.unpack('<I', packed[i:i + 4])[0]:08X}" for i in range(0, len(packed), 4))
    return f"{words}:{port:04X}"


def peer_uid(peer: tuple[str, int], local: tuple[str, int], proc_net: str = "/proc/net") -> int | None:
    """The owner of the socket at `peer` connected to `local` on this host (the client of an IPv4 connection
    may be an IPv6 socket, so both tables are read); None when it cannot be found."""
    for table, ipv6 in (("tcp", False), ("tcp6", True)):
        want = (proc_net_endpoint(*peer, ipv6=ipv6), proc_net_endpoint(*local, ipv6=ipv6))
        try:
            with open(f"{proc_net}/{table}", encoding="ascii") as rows:
                next(rows)
                for row in rows:
                    fields = row.split()
                    if len(fields) > 7 and (fields[1], fields[2]) == want:
                        return int(fields[7])
        except OSError:
            continue
    return None


class _Connection:
    """One client connection: requests in order on this thread, WAIT answered from a waiter thread."""

    def __init__(self, bridge: "TcpStoreBridge", sock: socket.socket) -> None:
        self.bridge, self.sock = bridge, sock
        self._send_lock = threading.Lock()
        self._waiter: threading.Thread | None = None
        self._cancel = threading.Event()
        self._answered = threading.Event()  # the pending WAIT got its answer

    # -- reading --

    def _exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("closed by the peer")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _u64(self) -> int:
        return struct.unpack("<Q", self._exact(8))[0]

    def _bytes(self, limit: int = MAX_VALUE_BYTES) -> bytes:
        n = self._u64()
        if n > limit:
            raise ProtocolError(f"a length of {n} bytes, more than {limit}")
        return self._exact(n)

    def _key(self) -> str:
        return self._bytes(MAX_KEY_BYTES + len(USER_KEY_PREFIX)).decode("utf-8", "surrogateescape")

    def _count(self) -> int:
        n = self._u64()
        if n > MAX_KEYS_PER_QUERY:
            raise ProtocolError(f"{n} keys in one query")
        return n

    def _keys(self) -> list[str]:
        return [self._key() for _ in range(self._count())]

    # -- writing --

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(data)

    def _send_bytes(self, value: bytes) -> None:
        self._send(struct.pack("<Q", len(value)) + value)

    def _send_i64(self, value: int) -> None:
        self._send(struct.pack("<q", value))

    # -- serving --

    def serve(self) -> None:
        try:
            self._validate()
            while True:
                self._query(Query(self._exact(1)[0]))
        except ValueError as exc:  # an unknown query type
            log.warning("tcpstore bridge %s: %s; connection closed", self.bridge.group, exc)
        except (ConnectionError, OSError):
            pass  # the peer went away
        except Exception as exc:  # noqa: BLE001 - any refusal ends this connection, not the bridge
            log.warning("tcpstore bridge %s: %s: %s; connection closed", self.bridge.group, type(exc).__name__, exc)
        finally:
            self._cancel.set()
            self.sock.close()

    def _validate(self) -> None:
        query, magic = struct.unpack("<BI", self._exact(5))
        if query != Query.VALIDATE or magic != VALIDATION_MAGIC:
            raise ProtocolError("the first query is not TCPStore's VALIDATE")

    def _query(self, query: Query) -> None:
        store = self.bridge
        if query == Query.PING:
            self._send(self._exact(4))
        elif query == Query.SET:
            key = self._key()
            store.set(key, self._bytes())
        elif query == Query.COMPARE_SET:
            key, expected = self._key(), self._bytes()
            self._send_bytes(store.compare_set(key, expected, self._bytes()))
        elif query == Query.GET:
            self._send_bytes(store.get(self._key()))
        elif query == Query.ADD:
            key = self._key()
            self._send_i64(store.add(key, struct.unpack("<q", self._exact(8))[0]))
        elif query == Query.CHECK:
            self._send(bytes([CHECK_READY if store.check(self._keys()) else CHECK_NOT_READY]))
        elif query == Query.WAIT:
            self._start_wait(self._keys())
        elif query == Query.CANCEL_WAIT:
            self._cancel_wait()
        elif query == Query.GETNUMKEYS:
            self._send_i64(store.num_keys())
        elif query == Query.DELETE_KEY:
            self._send_i64(int(store.delete_key(self._key())))
        elif query == Query.APPEND:
            key = self._key()
            store.append(key, self._bytes())
        elif query == Query.MULTI_GET:
            for key in self._keys():
                self._send_bytes(store.get(key))
        elif query == Query.MULTI_SET:
            for _ in range(self._count()):
                key = self._key()
                store.set(key, self._bytes())
        else:
            raise ProtocolError(f"query {query.name} is not served")

    def _start_wait(self, keys: list[str]) -> None:
        # A client asks again only once the last WAIT was answered (or cancelled): its waiter is ending.
        if self._waiter is not None:
            if not self._answered.is_set():
                raise ProtocolError("WAIT while a WAIT is pending")
            self._waiter.join()
        self._cancel.clear()
        self._answered.clear()
        self._waiter = threading.Thread(target=self._wait, args=(keys,), daemon=True,
                                        name=f"tcpstore-bridge-wait-{self.bridge.group}")
        self._waiter.start()

    def _wait(self, keys: list[str]) -> None:
        try:
            while not self._cancel.is_set() and not self.bridge.closed:
                if self.bridge.wait_slice(keys):
                    self._answered.set()
                    self._send(bytes([STOP_WAITING]))
                    return
        except Exception as exc:  # noqa: BLE001 - the waiting client learns it by the connection closing
            log.warning("tcpstore bridge %s: WAIT %s: %s", self.bridge.group, keys[:4], exc)
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _cancel_wait(self) -> None:
        self._cancel.set()
        if self._waiter is not None:
            self._waiter.join()
        self._answered.set()
        self._send(bytes([WAIT_CANCELED]))


class TcpStoreBridge:
    """Serves one group's keys of `store` (the trainer's rendezvous) to TCPStore clients of this host's user:
    `with TcpStoreBridge(store, group) as bridge:` then have the client connect to LOOPBACK:bridge.port."""

    def __init__(self, store: BlockingStore, group: str, *,
                 peer_uid_of: Callable[[tuple[str, int], tuple[str, int]], int | None] = peer_uid) -> None:
        self.store, self.group = store, group
        self.uid = os.geteuid()
        self._peer_uid_of = peer_uid_of
        self._local: dict[str, bytes] = {}
        self._local_lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((LOOPBACK, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._closed = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, daemon=True, name=f"tcpstore-bridge-{group}")
        self._acceptor.start()

    def __enter__(self) -> "TcpStoreBridge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for sock in list(self._connections):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            owner = self._peer_uid_of(peer[:2], (LOOPBACK, self.port))
            if owner != self.uid:
                log.warning("tcpstore bridge %s: refused %s:%d (socket owner %s, not uid %d)", self.group, *peer[:2],
                            owner, self.uid)
                sock.close()
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections.append(sock)
            threading.Thread(target=_Connection(self, sock).serve, daemon=True,
                             name=f"tcpstore-bridge-conn-{self.group}").start()

    # -- the keys: the group's go to the trainer, TCPStore's own stay here --

    def _remote(self, key: str) -> str | None:
        """The trainer-side key of a client's key; None for one kept here."""
        if not key.startswith(USER_KEY_PREFIX):
            if len(self._local) >= MAX_LOCAL_KEYS and key not in self._local:
                raise ProtocolError(f"more than {MAX_LOCAL_KEYS} keys of the client's own")
            return None
        remote = key[len(USER_KEY_PREFIX):]
        if not remote.startswith(f"{self.group}/"):
            raise ProtocolError(f"key {remote[:80]!r} is not of group {self.group}")
        return remote

    def set(self, key: str, value: bytes) -> None:
        remote = self._remote(key)
        if remote is None:
            with self._local_lock:
                self._local[key] = value
        else:
            self.store.set(remote, value)

    def get(self, key: str) -> bytes:
        remote = self._remote(key)
        if remote is None:
            with self._local_lock:
                if key not in self._local:
                    raise ProtocolError(f"GET of {key!r}, which is not set")
                return self._local[key]
        return self.store.get(remote)

    def add(self, key: str, delta: int) -> int:
        remote = self._remote(key)
        if remote is None:
            with self._local_lock:
                total = add_to(self._local.get(key), delta)
                self._local[key] = str(total).encode()
                return total
        return self.store.add(remote, delta)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        remote = self._remote(key)
        if remote is None:
            raise ProtocolError("COMPARE_SET of a key of the client's own")
        return self.store.compare_set(remote, expected, desired)

    def append(self, key: str, value: bytes) -> None:
        """torch's Store.append over compare_set, as torch's Store base class does it."""
        expected = value
        current = self.compare_set(key, b"", expected)
        while current != expected:
            expected = current + value
            current = self.compare_set(key, current, expected)

    def _split(self, keys: list[str]) -> tuple[list[str], bool]:
        """The trainer-side keys among `keys`, and whether those kept here are all set."""
        remote, local_set = [], True
        for key in keys:
            r = self._remote(key)
            if r is not None:
                remote.append(r)
            else:
                with self._local_lock:
                    local_set = local_set and key in self._local
        return remote, local_set

    def check(self, keys: list[str]) -> bool:
        remote, local_set = self._split(keys)
        return local_set and (not remote or self.store.check(remote))

    def wait_slice(self, keys: list[str]) -> bool:
        """Whether every key is set, after waiting at most about WAIT_SLICE_S."""
        remote, local_set = self._split(keys)
        if not local_set:  # another connection of the client sets it, if anything does
            self._closed.wait(LOCAL_WAIT_POLL_S)
            return False
        return not remote or self.store.wait_for(remote, WAIT_SLICE_S)

    def delete_key(self, key: str) -> bool:
        remote = self._remote(key)
        if remote is None:
            with self._local_lock:
                return self._local.pop(key, None) is not None
        return self.store.delete_key(remote)

    def num_keys(self) -> int:
        return self.store.num_keys()
