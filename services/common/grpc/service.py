"""What the trainer and rollout gRPC servers share.

- Status mapping: a handler raises, `StatusMap` names the code (RpcFailure carries its own, a listed
  exception type its code, anything else INTERNAL), and `rpc_handler` ends the RPC with it: a refusal
  is logged as one line, an INTERNAL failure with its traceback, the outcome counted per code. Every
  failure leaves the server serving.
- The version a service reports (the installed lockstep package).
- `GrpcServiceHost`, the process around one servicer: bearer-token and undecodable-message
  interceptors, grpc.health.v1, the Prometheus endpoint, and a graceful stop -- health answers
  NOT_SERVING from the moment it begins, so probes stop routing to a server that drains its
  in-flight RPCs for `shutdown_grace_s`.
"""
from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
from prometheus_client import CollectorRegistry, start_http_server

from services.common.auth import BearerToken, BearerTokenInterceptor
from services.common.grpc.decode import RefuseUndecodable
from services.common.grpc.health import add_health_service
from services.common.grpc.options import grpc_options
from services.common.process.structured_logging import log_event

UNKNOWN_VERSION = "0+unknown"


def package_version() -> str:
    """The installed lockstep package's version; UNKNOWN_VERSION when it runs from a plain checkout."""
    try:
        return importlib.metadata.version("lockstep")
    except importlib.metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


class RpcFailure(Exception):
    """Raised inside a handler to end the RPC with `code` and the message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StatusMap:
    """One service's exception -> status code mapping: the first listed type the exception is an
    instance of wins; RpcFailure carries its own code; anything else is INTERNAL (a bug)."""

    def __init__(self, *pairs: tuple[type[BaseException] | tuple[type[BaseException], ...], grpc.StatusCode]) -> None:
        self._pairs = pairs

    def __call__(self, exc: BaseException) -> grpc.StatusCode:
        if isinstance(exc, RpcFailure):
            return exc.code
        for kind, code in self._pairs:
            if isinstance(exc, kind):
                return code
        return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class RpcErrors:
    """How one service ends a failed RPC: its name (the counters' service label), its status
    mapping and the logger its refusals and failures go to."""

    service: str
    status_for: StatusMap
    logger: logging.Logger

    async def abort(self, context: grpc.aio.ServicerContext, rpc: str, exc: BaseException,
                    code: grpc.StatusCode | None = None) -> NoReturn:
        """End the RPC for `exc` with `code` (default: the mapped one), logging it first."""
        code = self.status_for(exc) if code is None else code
        if code == grpc.StatusCode.INTERNAL:
            self.logger.exception("%s failed", rpc)
            await context.abort(code, f"{rpc}: {type(exc).__name__}: {exc}")
        log_event(self.logger, "request refused", rpc=rpc, code=code.name, reason=str(exc))
        await context.abort(code, str(exc))
        raise AssertionError("unreachable: context.abort raises")


def rpc_handler(errors: RpcErrors, rpc: str, *, counter: str | None = None) -> Callable:
    """Decorator of a unary or stream-request handler: its exceptions end the RPC with their status
    (`errors`); `counter` (a collector in the servicer's `metrics`, labelled service and outcome)
    counts "ok" or the status code's name."""

    def wrap(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = await fn(self, request, context)
            except grpc.aio.AbortError:  # already ended with its status (an undecodable stream message)
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status, the server keeps serving
                code = errors.status_for(exc)
                if counter:
                    self.metrics[counter].labels(errors.service, code.name.lower()).inc()
                await errors.abort(context, rpc, exc, code)
            if counter:
                self.metrics[counter].labels(errors.service, "ok").inc()
            return result

        return handler

    return wrap


class GrpcServiceHost:
    """The process around one servicer: start() -> wait() -> stop()."""

    def __init__(self, service: str, add_servicer: Callable[[grpc.aio.Server], None], token: BearerToken, *,
                 host: str, grpc_port: int, metrics_port: int, registry: CollectorRegistry,
                 shutdown_grace_s: float, logger: logging.Logger) -> None:
        self.service = service
        self._add_servicer = add_servicer
        self._token = token
        self.host, self.metrics_port = host, metrics_port
        self._requested_port = grpc_port
        self.grpc_port = 0  # the bound port, once started (grpc_port 0 asks for any free one)
        self.registry = registry
        self.shutdown_grace_s = shutdown_grace_s
        self.logger = logger
        self.server: grpc.aio.Server | None = None
        self.health: Any = None  # grpc.health.v1 servicer (it needs the running event loop)
        self._metrics_server: Any = None
        self._stop_requested = asyncio.Event()

    async def start(self, **log_fields: object) -> None:
        server = grpc.aio.server(options=grpc_options(),
                                 interceptors=[BearerTokenInterceptor(self._token), RefuseUndecodable()])
        self._add_servicer(server)
        self.health = await add_health_service(server, self.service)
        self.grpc_port = server.add_insecure_port(f"{self.host}:{self._requested_port}")
        if self.grpc_port == 0:
            raise OSError(f"grpc_port: could not bind {self.host}:{self._requested_port}")
        if self.metrics_port:
            self._metrics_server, _ = start_http_server(self.metrics_port, addr=self.host, registry=self.registry)
        await server.start()
        self.server = server
        log_event(self.logger, f"{self.service} serving", host=self.host, grpc_port=self.grpc_port,
                  metrics_port=self.metrics_port or None, **log_fields)

    def request_stop(self) -> None:
        self._stop_requested.set()

    async def wait(self) -> None:
        await self._stop_requested.wait()

    async def stop(self) -> None:
        if self.health is not None:
            await self.health.enter_graceful_shutdown()  # NOT_SERVING while in-flight RPCs drain
        if self.server is not None:
            await self.server.stop(grace=self.shutdown_grace_s)
            self.server = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None


async def serve_until_signalled(host: GrpcServiceHost, *, close: Callable[[], Awaitable[None]],
                                **log_fields: object) -> None:
    """Start `host`, run until SIGTERM/SIGINT, then stop it gracefully and `close` what it served."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, host.request_stop)
    try:
        await host.start(**log_fields)
        await host.wait()
    finally:
        await host.stop()
        await close()
        log_event(host.logger, f"{host.service} stopped")
