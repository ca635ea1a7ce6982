"""The weight-broadcast rendezvous: the keys the ranks of a weight-update group meet at.

The ranks of one sync (services/common/weights/broadcast_protocol.py) exchange what their collective needs through
a torch.distributed store: the join barrier's keys, then gloo's addresses or NCCL's unique id -- the
secrets a process needs to join the communicator. The trainer holds those keys in a `KeyTable` and serves
it (services/common/rendezvous/service.py) on its weight_broadcast_address only, to callers that present
the deployment's token; its own rank reads the table in process (`LocalStore`, services/common/rendezvous/store.py).

A key belongs to one open group: it starts with the group's name and '/'. The trainer opens a group when
it plans a sync and closes it when the sync ends; closing deletes the group's keys and leaves a tombstone
naming why, so a rank still asking about the group learns the reason (`GroupClosed`) rather than waiting.
Any other key is refused (a check finds it not set). `RendezvousLimits` bounds what the table holds,
whoever writes it: a write that would pass a limit is refused (`StoreFull`) and stores nothing.

The ranks of a multi-rank trainer meet the same way, at a KeyTable of their own that rank 0 serves with
one group open for the group's lifetime (services/trainer/distributed/rank_rendezvous.py).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Keys are short names ("<group>/joined/1", "<group>/<group>//cpu//0/0"); far longer ones are a mistake.
MAX_KEY_BYTES = 1024
# Closed groups whose reason is kept for ranks that ask late (one per sync; a few syncs back is plenty).
TOMBSTONES_KEPT = 64


@dataclass(frozen=True)
class RendezvousLimits:
    """What the rendezvous holds at most, over every open group together."""

    max_keys: int = 16_384
    max_value_bytes: int = 1 << 20
    max_bytes: int = 64 << 20  # keys and values together

    def __post_init__(self) -> None:
        for name in ("max_keys", "max_value_bytes", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")


class RendezvousError(RuntimeError):
    """A store operation was refused; torch.distributed callers see it as the RuntimeError it is."""


class Unauthenticated(RendezvousError):
    """The rendezvous refused the caller before reading its request: no token, or not the deployment's."""


class KeyRefused(RendezvousError):
    """The key is malformed or belongs to no open group."""


class GroupClosed(KeyRefused):
    """The key's group was closed (finished or given up); `reason` says which."""

    def __init__(self, group: str, reason: str) -> None:
        super().__init__(f"group {group} is closed: {reason}")
        self.group, self.reason = group, reason


class StoreFull(RendezvousError):
    """The write would pass one of the RendezvousLimits; nothing was stored."""


def group_of(key: str) -> str:
    """The group a key names: everything before its first '/'."""
    group, sep, _ = key.partition("/")
    return group if sep else ""


def add_to(value: bytes | None, delta: int) -> int:
    """torch stores keep counters as decimal text."""
    if value is None:
        return delta
    try:
        return int(value.decode("ascii")) + delta
    except (UnicodeDecodeError, ValueError):
        raise RendezvousError(f"add: the key holds {value[:32]!r}, not a decimal counter") from None


class KeyTable:
    """Keys of the open groups, within `limits`; safe to use from any thread. Waiters are told when keys
    they wait for are set."""

    def __init__(self, limits: RendezvousLimits) -> None:
        self.limits = limits
        self._lock = threading.Condition()
        self._values: dict[str, bytes] = {}
        self._bytes = 0
        self._open: set[str] = set()
        self._closed: OrderedDict[str, str] = OrderedDict()

    # -- groups (the trainer's, never a caller's) --

    def open_group(self, group: str) -> None:
        if not group or "/" in group:
            raise ValueError(f"group_name: {group!r} must be non-empty without '/'")
        with self._lock:
            self._closed.pop(group, None)
            self._open.add(group)

    def close_group(self, group: str, reason: str) -> None:
        """Drop every key of `group`; later calls about it raise GroupClosed(reason)."""
        with self._lock:
            self._open.discard(group)
            for key in [k for k in self._values if group_of(k) == group]:
                self._drop(key)
            self._closed[group] = reason
            self._closed.move_to_end(group)
            while len(self._closed) > TOMBSTONES_KEPT:
                self._closed.popitem(last=False)
            self._lock.notify_all()  # waiters on the group's keys stop now

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes

    # -- torch.distributed.Store's operations --

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._checked(key)
            self._put(key, bytes(value))

    def get(self, key: str) -> bytes | None:
        with self._lock:
            self._checked(key)
            return self._values.get(key)

    def add(self, key: str, delta: int) -> int:
        with self._lock:
            self._checked(key)
            total = add_to(self._values.get(key), delta)
            self._put(key, str(total).encode("ascii"))
            return total

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            self._checked(key)
            current = self._values.get(key)
            if current is None:
                if expected:
                    return bytes(expected)  # as torch's TCPStore answers for a key that is not set
                self._put(key, bytes(desired))
            elif current == expected:
                self._put(key, bytes(desired))
            return self._values[key]

    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key is set. A key of no group is simply not set: NCCL's watchdog polls a key of
        its own ("exception_dump") beside the group's, and takes a refusal for a store gone away."""
        with self._lock:
            for key in keys:
                if group_of(key) in self._open or group_of(key) in self._closed:
                    self._checked(key)
            return all(k in self._values for k in keys)

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """Whether every key was set within `timeout_s`; GroupClosed as soon as their group closes."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                for key in keys:
                    self._checked(key)
                if all(k in self._values for k in keys):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)

    def delete_key(self, key: str) -> bool:
        with self._lock:
            self._checked(key)
            if key not in self._values:
                return False
            self._drop(key)
            return True

    def num_keys(self) -> int:
        with self._lock:
            return len(self._values)

    # -- under the lock --

    def _checked(self, key: str) -> None:
        if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
            raise KeyRefused(f"key: longer than {MAX_KEY_BYTES} bytes")
        group = group_of(key)
        if group in self._open:
            return
        if group in self._closed:
            raise GroupClosed(group, self._closed[group])
        raise KeyRefused(f"key: {key[:80]!r} belongs to no open weight-update group")

    def _put(self, key: str, value: bytes) -> None:
        limits = self.limits
        if len(value) > limits.max_value_bytes:
            raise StoreFull(f"value of {key[:80]!r}: {len(value)} bytes, more than max_value_bytes "
                            f"{limits.max_value_bytes}")
        old = self._values.get(key)
        if old is None and len(self._values) >= limits.max_keys:
            raise StoreFull(f"key {key[:80]!r}: the rendezvous holds max_keys {limits.max_keys} already")
        size = len(value) - len(old) if old is not None else len(key.encode()) + len(value)
        if self._bytes + size > limits.max_bytes:
            raise StoreFull(f"key {key[:80]!r}: {len(value)} more bytes would pass max_bytes {limits.max_bytes} "
                            f"(held: {self._bytes})")
        self._values[key] = value
        self._bytes += size
        self._lock.notify_all()

    def _drop(self, key: str) -> None:
        self._bytes -= len(self._values.pop(key)) + len(key.encode())
