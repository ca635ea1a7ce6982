"""The weight-broadcast rendezvous in tests: one served in the test's process, and an intruder.

Tests that play the trainer (rank 0) host one: its KeyTable behind a real RendezvousServer on loopback,
the groups they broadcast in opened, their rank 0 reading it in process (LocalStore) and every other rank
reaching it over gRPC with the token (RendezvousClient), as a replica does. `Intruder` hammers any
rendezvous without the token; `listening_ips` says where a process listens.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
import threading

import grpc
import psutil

from proto import rendezvous_pb2 as rpb
from proto import rendezvous_pb2_grpc as rpb_grpc
from services.common.auth import BearerToken, generate_token
from services.common.process.ports import free_port
from services.common.rendezvous.key_table import KeyTable, RendezvousError, RendezvousLimits
from services.common.rendezvous.service import RendezvousServer
from services.common.rendezvous.store import LocalStore, RendezvousClient
from services.common.weights.broadcast_protocol import abandoned_key, formed_key, joined_key


class HostedRendezvous:
    """`with HostedRendezvous("g") as rdv:` -- served at rdv.address until the block ends."""

    def __init__(self, *groups: str, limits: RendezvousLimits = RendezvousLimits(),
                 token: BearerToken | None = None) -> None:
        self.token = token or BearerToken(generate_token())
        self.table = KeyTable(limits)
        self.address = f"127.0.0.1:{free_port()}"
        self.server = RendezvousServer(self.table, self.token, self.address)
        for group in groups:
            self.table.open_group(group)

    def __enter__(self) -> "HostedRendezvous":
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace_s=0)

    def local(self, timeout_s: float) -> LocalStore:
        """Rank 0's store, as the trainer's."""
        return LocalStore(self.table, timeout_s)

    def client(self, timeout_s: float, token: BearerToken | None = None) -> RendezvousClient:
        """Another rank's store, as a replica's (with another token: an intruder's)."""
        return RendezvousClient(self.address, token or self.token, timeout_s)


def listening_ips(pid: int, port: int) -> list[str]:
    """The addresses process `pid` listens on at `port` (IPv4-mapped IPv6 ones as their IPv4 address; an
    IPv6 socket on "::" listens on every interface of both families)."""
    out = []
    for conn in psutil.Process(pid).net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
            ip = ipaddress.ip_address(conn.laddr.ip)
            mapped = getattr(ip, "ipv4_mapped", None)
            out.append(str(mapped or ip))
    return sorted(out)


class Intruder(threading.Thread):
    """Hammers a rendezvous without the deployment's token: every store operation on the join-barrier keys
    of `groups` (the 'abandoned' key the barrier obeys included), with a wrong token and with none, a large
    value, and torch's TCPStore protocol spoken to the port, as to the store it replaced. round() tries each
    once; start() repeats rounds until stop(). What was not refused goes to `accepted`; `attempts` counts
    every try."""

    def __init__(self, address: str, groups: list[str], *, value_bytes: int = 1 << 20) -> None:
        super().__init__(daemon=True, name="intruder")
        self.address, self.groups, self.value = address, groups, b"\0" * value_bytes
        self.attempts, self.accepted = 0, []
        self._halt = threading.Event()
        self._wrong = RendezvousClient(address, BearerToken(generate_token()), 1)
        self._anonymous = grpc.insecure_channel(address)
        self._stub = rpb_grpc.RendezvousStub(self._anonymous)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=60)
        self._wrong.close()
        self._anonymous.close()

    def run(self) -> None:
        while not self._halt.is_set():
            self.round()

    def round(self) -> None:
        for group in self.groups:
            keys = (abandoned_key(group), formed_key(group), joined_key(group, 1), f"{group}/{group}/x")
            for name, attempt in self._attempts(self._wrong, self._stub, keys):
                self._try(name, attempt)
        self._try("tcpstore", self._tcpstore_set)

    def _attempts(self, wrong: RendezvousClient, stub, keys: tuple[str, ...]):
        abandoned, formed, joined, other = keys
        yield "set abandoned", lambda: wrong.set(abandoned, b"intruder: give up")
        yield "set formed", lambda: wrong.set(formed, b"1")
        yield "set joined", lambda: wrong.set(joined, b"1")
        yield "get joined", lambda: wrong.get_now(joined)
        yield "check", lambda: wrong.check([joined, abandoned])
        yield "add", lambda: wrong.add(other, 1)
        yield "compare_set", lambda: wrong.compare_set(other, b"", b"x")
        yield "delete", lambda: wrong.delete_key(joined)
        yield "num_keys", wrong.num_keys
        yield "large value", lambda: wrong.set(other, self.value)
        yield "anonymous set abandoned", lambda: stub.Set(rpb.SetRequest(key=abandoned, value=b"x"), timeout=5)
        yield "anonymous get", lambda: stub.Get(rpb.KeyRequest(key=joined), timeout=5)

    def _try(self, name: str, attempt) -> None:
        self.attempts += 1
        try:
            attempt()
        except (RendezvousError, grpc.RpcError, ConnectionError, OSError):
            return
        self.accepted.append(name)

    def _tcpstore_set(self) -> None:
        """VALIDATE, then SET of the first group's abandoned key, as a TCPStore client sends them; a store
        that took it would answer a PING after it."""
        host, _, port = self.address.rpartition(":")
        key = abandoned_key(self.groups[0]).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(struct.pack("<BI", 0, 0x3C85F7CE) + struct.pack("<BQ", 1, len(key)) + key
                         + struct.pack("<Q", 1) + b"x" + struct.pack("<BI", 13, 7))
            reply = b""
            while len(reply) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        if struct.pack("<I", 7) not in reply[:4]:
            raise ConnectionError("not a TCPStore")
