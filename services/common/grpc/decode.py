"""Undecodable request messages answer INVALID_ARGUMENT, naming the message type.

grpc.aio deserializes requests itself: a DecodeError there ends a unary call
with UNKNOWN and surfaces inside a streaming handler as an exception its own
error mapping calls INTERNAL. This interceptor (installed on every Lockstep
server) wraps each method's deserializer so that a message that does not
parse becomes a marker, and the call is aborted with INVALID_ARGUMENT before
(unary) or while (streaming) the handler reads it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message that did not parse."""

    method: str
    reason: str

    def message(self, index: int | None = None) -> str:
        where = "request" if index is None else f"message[{index}]"
        return f"{where}: undecodable for {self.method} ({self.reason})"


def _safe(deserializer: Callable[[bytes], Any] | None, method: str) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return Undecodable(method, str(exc))

    return deserialize


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    index = 0
    async for request in requests:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message(index))
        yield request
        index += 1


def _wrap(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = _safe(handler.request_deserializer, method)
    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        inner_uu = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
            return await inner_uu(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, serialize)
    if handler.unary_stream is not None:
        inner_us = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())
            async for response in inner_us(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, serialize)
    if handler.stream_unary is not None:
        inner_su = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await inner_su(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, serialize)
    inner_ss = handler.stream_stream

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in inner_ss(_checked(requests, context), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, serialize)


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    """Server interceptor: an undecodable request message -> INVALID_ARGUMENT naming its method."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _wrap(handler, handler_call_details.method)
