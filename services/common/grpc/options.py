"""Explicit gRPC message-size limits, the same on both ends of every channel.

gRPC's default receive limit is 4 MiB; a GenerateResponse for a large batch or
a TrainStep trajectory stream item can exceed it, and weight chunks are sized
well below it. Every server and channel in Lockstep is built with these
options so that the limit is a decision, not an accident.
"""
from __future__ import annotations

import grpc

from services.common.auth import BearerToken, SyncBearerTokenClientInterceptor, aio_client_interceptors

MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def insecure_channel(address: str, token: BearerToken, max_message_bytes: int = MAX_MESSAGE_BYTES,
                     max_reconnect_backoff_ms: int | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel whose every call carries `token` (services refuse calls without it)."""
    options: list[tuple[str, int]] = grpc_options(max_message_bytes)
    if max_reconnect_backoff_ms is not None:
        options.append(("grpc.max_reconnect_backoff_ms", max_reconnect_backoff_ms))
    return grpc.aio.insecure_channel(address, options=options, interceptors=aio_client_interceptors(token))


def sync_channel(address: str, token: BearerToken, max_message_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A blocking channel whose every call carries `token` (tools, healthchecks, tests)."""
    channel = grpc.insecure_channel(address, options=grpc_options(max_message_bytes))
    return grpc.intercept_channel(channel, SyncBearerTokenClientInterceptor(token))
