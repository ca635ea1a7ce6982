"""services.common.auth: token loading and checking, and the gRPC interceptors on a real in-process server."""
from __future__ import annotations

import asyncio
import stat

import grpc
import pytest

from services.common import auth
from services.common.auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    AuthConfigError,
    BearerToken,
    BearerTokenInterceptor,
    generate_token,
    load_token,
    write_token_file,
)
from services.common.grpc.options import insecure_channel


def test_token_sources_in_order_and_refusals(tmp_path):
    a, b, c = generate_token(), generate_token(), generate_token()
    fa, fb = write_token_file(tmp_path / "a", a), write_token_file(tmp_path / "b", b)
    env = {TOKEN_FILE_ENV: str(fb), TOKEN_ENV: c}
    assert load_token(str(fa), env).matches(a)  # the service's own setting first
    assert load_token("", env).matches(b)  # then the file named in the environment
    assert load_token("", {TOKEN_ENV: c}).matches(c)  # then the token itself
    with pytest.raises(AuthConfigError, match="no authentication token"):
        load_token("", {})
    with pytest.raises(AuthConfigError, match="auth_token_file: cannot read"):
        load_token(str(tmp_path / "missing"), {})
    with pytest.raises(AuthConfigError, match=f"\\${TOKEN_ENV}: .*at least 32"):
        load_token("", {TOKEN_ENV: "short"})
    with pytest.raises(AuthConfigError, match="printable ASCII"):
        BearerToken("x" * 20 + " " + "y" * 20)


def test_token_file_is_private_and_never_overwritten(tmp_path):
    path = write_token_file(tmp_path / "token")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = path.read_text()
    with pytest.raises(FileExistsError):
        write_token_file(path)
    assert path.read_text() == first


def test_token_is_never_shown_and_compared_in_constant_time(monkeypatch):
    secret = generate_token()
    token = BearerToken(secret)
    assert secret not in repr(token) and secret not in str(token) and secret not in f"{token}"
    calls = []

    def compare(x, y):
        calls.append((x, y))
        return x == y

    monkeypatch.setattr(auth.hmac, "compare_digest", compare)
    assert token.matches_header(f"Bearer {secret}") and token.matches_header(f"bearer {secret}")
    assert not token.matches_header(f"Bearer {secret}x")
    assert not token.matches_header(secret) and not token.matches_header(None) and not token.matches_header("Bearer ")
    assert len(calls) == 3  # every candidate token went through hmac.compare_digest


def test_interceptor_guards_every_method_but_the_standard_health_check():
    token, wrong = BearerToken(generate_token()), BearerToken(generate_token())

    async def echo(request: bytes, context) -> bytes:
        return b"ok:" + request

    async def scenario() -> dict[str, object]:
        server = grpc.aio.server(interceptors=[BearerTokenInterceptor(token)])
        server.add_generic_rpc_handlers([
            grpc.method_handlers_generic_handler("demo.Svc", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),
            grpc.method_handlers_generic_handler("grpc.health.v1.Health",
                                                 {"Check": grpc.unary_unary_rpc_method_handler(echo)}),
        ])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out: dict[str, object] = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
                for name in ("/demo.Svc/Echo", "/grpc.health.v1.Health/Check", "/demo.Svc/Missing"):
                    try:
                        out[f"bare {name}"] = await bare.unary_unary(name)(b"x", timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        out[f"bare {name}"] = exc.code()
            for label, t in (("token", token), ("wrong", wrong)):
                async with insecure_channel(f"127.0.0.1:{port}", t) as ch:
                    try:
                        out[label] = await ch.unary_unary("/demo.Svc/Echo")(b"y", timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        out[label] = exc.code()
        finally:
            await server.stop(None)
        return out

    out = asyncio.run(scenario())
    assert out == {
        "bare /demo.Svc/Echo": grpc.StatusCode.UNAUTHENTICATED,
        "bare /grpc.health.v1.Health/Check": b"ok:x",
        "bare /demo.Svc/Missing": grpc.StatusCode.UNIMPLEMENTED,
        "token": b"ok:y",
        "wrong": grpc.StatusCode.UNAUTHENTICATED,
    }
