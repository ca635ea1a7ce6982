"""The rendezvous over the network: the trainer's gRPC server of its KeyTable.

`RendezvousServer` serves a KeyTable (services/common/rendezvous/key_table.py) as the gRPC service of
proto/rendezvous.proto, bound to the configured host:port only (no SO_REUSEPORT, so a port in use fails
the start), behind the deployment's bearer token: a call without it is answered UNAUTHENTICATED before
its message is read. Messages are limited to what two values of max_value_bytes need, so nothing larger
is received from anyone. Refusals: RESOURCE_EXHAUSTED when a write would pass a limit;
FAILED_PRECONDITION for a key of no open group (a closed one's reason in the trailing metadata; Check
answers such a key is not set); NOT_FOUND for a Get of a key that is not set; INVALID_ARGUMENT for a
malformed request.

Its client, a torch.distributed.Store, is services/common/rendezvous/store.py's RendezvousClient.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from proto import rendezvous_pb2 as rpb
from proto import rendezvous_pb2_grpc as rpb_grpc
from services.common.auth import BearerToken, SyncBearerTokenInterceptor
from services.common.grpc.options import grpc_options
from services.common.rendezvous.key_table import (
    MAX_KEY_BYTES, GroupClosed, KeyRefused, KeyTable, RendezvousError, StoreFull,
)

# One Wait call waits at most this long; a client waiting longer asks again. Keeps every handler short,
# so a few waiting ranks never hold all of the server's threads for long.
WAIT_SLICE_S = 0.5
SERVER_THREADS = 32
# Keys one Check or Wait may name (a group's ranks at most; torch asks about one or a few).
MAX_KEYS_PER_CALL = 4096
# Room in a message for its keys and framing, beside its values.
MESSAGE_OVERHEAD_BYTES = MAX_KEYS_PER_CALL * 16 + 4 * MAX_KEY_BYTES
CLOSED_REASON_KEY = "rendezvous-closed-reason-bin"
# A call other than Wait that takes longer than this has lost the server.
CALL_TIMEOUT_S = 60.0


def max_message_bytes(max_value_bytes: int) -> int:
    """The largest message either side needs: CompareSet carries two values."""
    return 2 * max_value_bytes + MESSAGE_OVERHEAD_BYTES


class _Servicer(rpb_grpc.RendezvousServicer):
    def __init__(self, table: KeyTable) -> None:
        self.table = table

    def _run(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except GroupClosed as exc:
            context.set_trailing_metadata(((CLOSED_REASON_KEY, exc.reason.encode()),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except KeyRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except StoreFull as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RendezvousError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @staticmethod
    def _keys(keys: Sequence[str], context: grpc.ServicerContext) -> list[str]:
        if not keys or len(keys) > MAX_KEYS_PER_CALL:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"keys: {len(keys)}, need 1..{MAX_KEYS_PER_CALL}")
        return list(keys)

    def Set(self, request: rpb.SetRequest, context) -> rpb.SetResponse:
        self._run(context, lambda: self.table.set(request.key, request.value))
        return rpb.SetResponse()

    def Get(self, request: rpb.KeyRequest, context) -> rpb.ValueResponse:
        value = self._run(context, lambda: self.table.get(request.key))
        if value is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"key: {request.key[:80]!r} is not set")
        return rpb.ValueResponse(value=value)

    def Add(self, request: rpb.AddRequest, context) -> rpb.AddResponse:
        return rpb.AddResponse(value=self._run(context, lambda: self.table.add(request.key, request.delta)))

    def CompareSet(self, request: rpb.CompareSetRequest, context) -> rpb.ValueResponse:
        return rpb.ValueResponse(value=self._run(
            context, lambda: self.table.compare_set(request.key, request.expected, request.desired)))

    def Check(self, request: rpb.KeysRequest, context) -> rpb.ReadyResponse:
        keys = self._keys(request.keys, context)
        return rpb.ReadyResponse(ready=self._run(context, lambda: self.table.check(keys)))

    def Wait(self, request: rpb.WaitRequest, context) -> rpb.ReadyResponse:
        keys = self._keys(request.keys, context)
        wait_s = min(request.wait_ms / 1000, WAIT_SLICE_S)
        return rpb.ReadyResponse(ready=self._run(context, lambda: self.table.wait(keys, wait_s)))

    def DeleteKey(self, request: rpb.KeyRequest, context) -> rpb.DeleteResponse:
        return rpb.DeleteResponse(deleted=self._run(context, lambda: self.table.delete_key(request.key)))

    def NumKeys(self, request: rpb.NumKeysRequest, context) -> rpb.NumKeysResponse:
        return rpb.NumKeysResponse(keys=self.table.num_keys())


class RendezvousServer:
    """Serves `table` at `address` (host:port, that host only) to callers holding `token`."""

    def __init__(self, table: KeyTable, token: BearerToken, address: str, *, field: str = "address") -> None:
        self.table, self.address, self.field = table, address, field
        self._token = token
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            size = max_message_bytes(self.table.limits.max_value_bytes)
            server = grpc.server(
                ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="rendezvous"),
                interceptors=[SyncBearerTokenInterceptor(self._token)],
                options=[*grpc_options(size), ("grpc.so_reuseport", 0)],
            )
            rpb_grpc.add_RendezvousServicer_to_server(_Servicer(self.table), server)
            try:
                port = server.add_insecure_port(self.address)
            except RuntimeError as exc:  # grpcio raises where older versions answered 0
                raise OSError(f"{self.field}: cannot listen on {self.address}: {exc}") from None
            if port == 0:
                raise OSError(f"{self.field}: cannot listen on {self.address}")
            server.start()
            self._server = server

    def stop(self, grace_s: float | None = None) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace_s).wait()
                self._server = None
