"""The rendezvous as torch.distributed stores: what a process group is handed.

`LocalStore` is the trainer's own rank's view of its KeyTable (services/common/rendezvous/key_table.py), no network
in between. `RendezvousClient` is a replica's: every operation one call of the trainer's Rendezvous
service (services/common/rendezvous/service.py) carrying the deployment's token; a refusal raises
RendezvousError, GroupClosed when the trainer closed the group (with its reason), Unauthenticated when
the token is not the deployment's. Both wait for keys as
torch stores do (get waits for its key; wait raises DistStoreError at the timeout); a client's waits are
long polls of at most WAIT_SLICE_S each.

A store written in Python lives only while Python holds a reference to it: a process group built on one
does not keep it alive, so its owner must (WeightUpdateGroup does).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import grpc
import torch.distributed as dist

from proto import rendezvous_pb2 as rpb
from proto import rendezvous_pb2_grpc as rpb_grpc
from services.common.auth import BearerToken
from services.common.grpc.options import sync_channel
from services.common.rendezvous.key_table import (GroupClosed, KeyRefused, KeyTable, RendezvousError, StoreFull,
                                        Unauthenticated, group_of)
from services.common.rendezvous.service import CALL_TIMEOUT_S, CLOSED_REASON_KEY, WAIT_SLICE_S


def as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def store_timeout_s(timeout: timedelta | None, default_s: float) -> float:
    return default_s if timeout is None else max(timeout.total_seconds(), 0.0)


class BlockingStore(dist.Store):
    """torch.distributed.Store's wait and get over two primitives of the subclass: `wait_for` (True once
    every key is set, False at the timeout) and `get_now` (None for a key that is not set)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        raise NotImplementedError

    def get_now(self, key: str) -> bytes | None:
        raise NotImplementedError

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = store_timeout_s(timeout, self.timeout_s)
        if not self.wait_for(keys, timeout_s):
            raise dist.DistStoreError(f"rendezvous: keys {keys[:4]} not set within {timeout_s:g} s")

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self.get_now(key)
        if value is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"rendezvous: key {key!r} is not set")
        return value


class LocalStore(BlockingStore):
    """The trainer's own rank's view of its KeyTable (no network in between)."""

    def __init__(self, table: KeyTable, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.table = table

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        return self.table.wait(keys, timeout_s)

    def get_now(self, key: str) -> bytes | None:
        return self.table.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.table.set(key, as_bytes(value))

    def add(self, key: str, value: int) -> int:
        return self.table.add(key, value)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.table.compare_set(key, as_bytes(expected), as_bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self.table.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.table.delete_key(key)

    def num_keys(self) -> int:
        return self.table.num_keys()


class RendezvousClient(BlockingStore):
    """A torch.distributed.Store at a trainer's rendezvous, every call carrying `token`. A refused call
    raises RendezvousError (GroupClosed when the group is over, with the trainer's reason)."""

    def __init__(self, address: str, token: BearerToken, timeout_s: float) -> None:
        super().__init__(timeout_s)
        self.address = address
        self._channel = sync_channel(address, token)
        self._stub = rpb_grpc.RendezvousStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request: Any, keys: Sequence[str], timeout_s: float = CALL_TIMEOUT_S) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error(method, exc, keys) from None

    def _error(self, method: str, exc: grpc.RpcError, keys: Sequence[str]) -> RendezvousError:
        code = exc.code()
        for key, value in exc.trailing_metadata() or ():
            if key == CLOSED_REASON_KEY and keys:
                return GroupClosed(group_of(keys[0]), bytes(value).decode(errors="replace"))
        message = f"rendezvous {self.address}: {method}: {code.name if code else 'error'}: {exc.details()}"
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return Unauthenticated(message)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return StoreFull(message)
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return KeyRefused(message)
        return RendezvousError(message)

    def wait_for(self, keys: Sequence[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            slice_s = max(0.0, min(left, WAIT_SLICE_S))
            request = rpb.WaitRequest(keys=list(keys), wait_ms=int(slice_s * 1000))
            if self._call("Wait", request, keys, slice_s + CALL_TIMEOUT_S).ready:
                return True
            if left <= WAIT_SLICE_S:
                return False

    def get_now(self, key: str) -> bytes | None:
        try:
            return self._stub.Get(rpb.KeyRequest(key=key), timeout=CALL_TIMEOUT_S).value
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._error("Get", exc, [key]) from None

    def set(self, key: str, value: str | bytes) -> None:
        self._call("Set", rpb.SetRequest(key=key, value=as_bytes(value)), [key])

    def add(self, key: str, value: int) -> int:
        return self._call("Add", rpb.AddRequest(key=key, delta=value), [key]).value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("CompareSet", rpb.CompareSetRequest(key=key, expected=as_bytes(expected),
                                                              desired=as_bytes(desired)), [key]).value

    def check(self, keys: list[str]) -> bool:
        return self._call("Check", rpb.KeysRequest(keys=list(keys)), keys).ready

    def delete_key(self, key: str) -> bool:
        return self._call("DeleteKey", rpb.KeyRequest(key=key), [key]).deleted

    def num_keys(self) -> int:
        return self._call("NumKeys", rpb.NumKeysRequest(), []).keys
