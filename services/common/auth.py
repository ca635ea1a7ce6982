"""The shared bearer token: loading it, checking it, and sending it.

Every Lockstep service (coordinator REST, trainer and rollout gRPC) refuses a
call that does not carry the one token of the deployment, and every Lockstep
client sends it: `authorization: Bearer <token>` (HTTP header, gRPC metadata).

Where the token comes from, first found wins:
1. the service's own `auth_token_file` setting (flag / LOCKSTEP_<SERVICE>_AUTH_TOKEN_FILE);
2. $LOCKSTEP_AUTH_TOKEN_FILE: a file holding it (compose secrets, the local launchers);
3. $LOCKSTEP_AUTH_TOKEN: the token itself.
Without any of them a service refuses to start: there is no unauthenticated
mode, because the launchers (services.local_stack, services.ray_stack) generate
a token anyway and an opt-out is what ends up copied into deployments.
`python -m services.common.auth FILE` writes a fresh token to FILE (mode 0600).

The token never appears in logs or reprs (`BearerToken` hides it) and is
compared in constant time (hmac.compare_digest).
"""
from __future__ import annotations

import collections
import hmac
import os
import secrets
import string
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import grpc

TOKEN_FILE_ENV = "LOCKSTEP_AUTH_TOKEN_FILE"
TOKEN_ENV = "LOCKSTEP_AUTH_TOKEN"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
MIN_TOKEN_CHARS = 32
# Printable ASCII without whitespace: what an HTTP header and gRPC metadata carry unchanged.
_TOKEN_CHARS = frozenset(string.ascii_letters + string.digits + string.punctuation)

# The standard gRPC health service answers SERVING/NOT_SERVING and changes nothing; container
# healthchecks and load balancers probe it without secrets. Every other method needs the token.
OPEN_GRPC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})

MISSING_TOKEN_HELP = (
    f"no authentication token: set auth_token_file, ${TOKEN_FILE_ENV} (a file holding the shared token) or "
    f"${TOKEN_ENV}; `python -m services.common.auth FILE` writes a new one. Lockstep services do not run "
    "without authentication."
)


class AuthConfigError(ValueError):
    """No usable token: the service must not start."""


class BearerToken:
    """The shared secret. Its repr and str never show the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = check_token(value)

    def __repr__(self) -> str:
        return "BearerToken(<hidden>)"

    __str__ = __repr__

    @property
    def header(self) -> str:
        """The value of an `authorization` header or metadata entry."""
        return f"Bearer {self._value}"

    @property
    def secret(self) -> str:
        """The raw token, for handing to a child process or writing a token file."""
        return self._value

    def matches(self, presented: str | None) -> bool:
        """Whether `presented` (a raw token) is this token; constant time in the token's content."""
        if presented is None:
            return False
        return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._value.encode())

    def matches_header(self, header: str | None) -> bool:
        return self.matches(bearer_credentials(header))


def check_token(value: str) -> str:
    if len(value) < MIN_TOKEN_CHARS:
        raise AuthConfigError(f"authentication token: must be at least {MIN_TOKEN_CHARS} characters, got {len(value)}")
    if not set(value) <= _TOKEN_CHARS:
        raise AuthConfigError("authentication token: only printable ASCII without whitespace is allowed")
    return value


def bearer_credentials(header: str | None) -> str | None:
    """The token of an 'authorization: Bearer <token>' value; None for anything else."""
    if not header:
        return None
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() != "bearer" or not credentials:
        return None
    return credentials


def generate_token() -> str:
    return secrets.token_urlsafe(32)  # 43 characters of the URL-safe alphabet


def write_token_file(path: str | Path, token: str | None = None) -> Path:
    """Write `token` (a new one by default) to a file only its owner can read; refuses to overwrite."""
    path = Path(path)
    value = check_token(token if token is not None else generate_token())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return path


def read_token_file(path: str | Path) -> BearerToken:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AuthConfigError(f"auth_token_file: cannot read {path}: {exc.strerror or exc}") from None
    try:
        return BearerToken(text.strip())
    except AuthConfigError as exc:
        raise AuthConfigError(f"auth_token_file: {path}: {exc}") from None


def load_token(token_file: str = "", environ: Mapping[str, str] | None = None) -> BearerToken:
    """The token from `token_file`, else $LOCKSTEP_AUTH_TOKEN_FILE, else $LOCKSTEP_AUTH_TOKEN; AuthConfigError if none."""
    env = os.environ if environ is None else environ
    path = token_file or env.get(TOKEN_FILE_ENV, "")
    if path:
        return read_token_file(path)
    if env.get(TOKEN_ENV):
        try:
            return BearerToken(env[TOKEN_ENV].strip())
        except AuthConfigError as exc:
            raise AuthConfigError(f"${TOKEN_ENV}: {exc}") from None
    raise AuthConfigError(MISSING_TOKEN_HELP)


def load_token_or_exit(token_file: str = "") -> BearerToken:
    """For service entry points: a clear message and exit status 2 instead of a traceback."""
    try:
        return load_token(token_file)
    except AuthConfigError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


# ------------------------------------------------------------------ gRPC server --

UNAUTHENTICATED_DETAILS = "missing or invalid bearer token (send metadata 'authorization: Bearer <token>')"


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item in metadata or ():
        k, v = item
        if k == key:
            return v.decode("ascii", "replace") if isinstance(v, bytes) else v
    return None


async def _refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that answers UNAUTHENTICATED without reading the request.

    No deserializer: nothing an unauthenticated caller sent is parsed."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_refuse)
    return grpc.unary_unary_rpc_method_handler(_refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Every method except OPEN_GRPC_METHODS answers UNAUTHENTICATED unless the call carries the token."""

    def __init__(self, token: BearerToken) -> None:
        self._token = token

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_GRPC_METHODS:
            return handler  # unknown methods stay UNIMPLEMENTED
        if self._token.matches_header(_metadata_value(handler_call_details.invocation_metadata, METADATA_KEY)):
            return handler
        return _refusing_handler(handler)


def _refuse_sync(request_iterator: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)


class SyncBearerTokenInterceptor(grpc.ServerInterceptor):
    """BearerTokenInterceptor for a synchronous grpc.server. A call without the token is answered
    UNAUTHENTICATED by a request-streaming handler that never reads: whatever the caller sends is not
    received whole, let alone parsed."""

    def __init__(self, token: BearerToken) -> None:
        self._token = token

    def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in OPEN_GRPC_METHODS:
            return handler
        if self._token.matches_header(_metadata_value(handler_call_details.invocation_metadata, METADATA_KEY)):
            return handler
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(_refuse_sync)
        return grpc.stream_unary_rpc_method_handler(_refuse_sync)


# ------------------------------------------------------------------ gRPC clients --

class _AioBearerToken:
    def __init__(self, token: BearerToken) -> None:
        self._token = token

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
        metadata.add(METADATA_KEY, self._token.header)
        return details._replace(metadata=metadata)


class _AioUnaryUnary(_AioBearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStream(_AioBearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _AioStreamUnary(_AioBearerToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


class _AioStreamStream(_AioBearerToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def aio_client_interceptors(token: BearerToken) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the token to every call of a grpc.aio channel: one per call kind, because a
    grpc.aio channel files each interceptor under the first kind it implements only."""
    return [kind(token) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _SyncCallDetails(
    collections.namedtuple("_SyncCallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                                "compression")),
    grpc.ClientCallDetails,
):
    pass


class SyncBearerTokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the token to every call of a synchronous channel (tools, healthchecks, tests)."""

    def __init__(self, token: BearerToken) -> None:
        self._token = token

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(d.metadata or ()), (METADATA_KEY, self._token.header)]
        return _SyncCallDetails(d.method, d.timeout, metadata, d.credentials,
                                getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m services.common.auth FILE   (writes a new token to FILE, mode 0600)", file=sys.stderr)
        return 2
    try:
        write_token_file(args[0])
    except FileExistsError:
        print(f"{args[0]} exists; not overwritten", file=sys.stderr)
        return 1
    print(args[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
