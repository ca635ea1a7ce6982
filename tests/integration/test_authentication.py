"""Authentication of every service, checked against the real stack (processes on loopback).

Every gRPC method of both services and every /v1 route of the REST API is
taken from the service's own descriptor / OpenAPI document, so a method or
route added later is covered without touching this file.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from recipes.tiny_model import build_model_dir
from services.common.auth import TOKEN_ENV, TOKEN_FILE_ENV, BearerToken, generate_token
from services.common.grpc.options import grpc_options, sync_channel
from services.local_stack import REPO_ROOT

WRONG = BearerToken(generate_token())


@pytest.fixture(scope="module")
def stack(one_replica_stack):
    return one_replica_stack  # shared (tests/integration/conftest.py): these tests change nothing in it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def grpc_methods(service: str) -> list[tuple[str, bool, bool]]:
    """(path, client streaming, server streaming) of every method the service declares."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    return [(f"/{descriptor.full_name}/{m.name}", m.client_streaming, m.server_streaming) for m in descriptor.methods]


def call_raw(channel: grpc.Channel, method: str, client_streaming: bool, server_streaming: bool,
             metadata: tuple = ()) -> grpc.StatusCode:
    """Call `method` with an empty message (raw bytes: no stub, so no method is left out); its status."""
    kind = {(False, False): channel.unary_unary, (True, False): channel.stream_unary,
            (False, True): channel.unary_stream, (True, True): channel.stream_stream}[(client_streaming, server_streaming)]
    call = kind(method)  # no serializers: bytes in, bytes out
    request = iter([b""]) if client_streaming else b""
    try:
        result = call(request, timeout=30, metadata=metadata)
        if server_streaming:
            list(result)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["Trainer", "Rollout"])
def test_every_grpc_method_refuses_calls_without_the_token(stack, service):
    port = stack.trainer_port if service == "Trainer" else stack.rollout_ports[0]
    methods = grpc_methods(service)
    assert len(methods) >= 5
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as bare:
        for method, cs, ss in methods:
            assert call_raw(bare, method, cs, ss) == grpc.StatusCode.UNAUTHENTICATED, method
            for header in (WRONG.header, stack.token.secret, "Basic " + stack.token.secret, "Bearer "):
                assert call_raw(bare, method, cs, ss, (("authorization", header),)) == \
                    grpc.StatusCode.UNAUTHENTICATED, (method, header[:7])
    # With the token every method is answered by its handler (empty requests are refused on their merits).
    with sync_channel(f"127.0.0.1:{port}", stack.token) as authed:
        for method, cs, ss in methods:
            assert call_raw(authed, method, cs, ss) not in (grpc.StatusCode.UNAUTHENTICATED,
                                                            grpc.StatusCode.UNIMPLEMENTED), method


def test_an_unauthenticated_load_model_changes_nothing(stack, model_dir):
    request = pb.LoadModelRequest(run_id="intruder", model_path=str(model_dir), policy_version=0,
                                  engine_config_json='{"engine": "torch"}')
    address = f"127.0.0.1:{stack.rollout_ports[0]}"
    with grpc.insecure_channel(address, options=grpc_options()) as bare:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RolloutStub(bare).LoadModel(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with sync_channel(address, stack.token) as authed:
        info = pb_grpc.RolloutStub(authed).Info(pb.InfoRequest(), timeout=10)
    assert info.run_id != "intruder" and info.model_path != str(model_dir)


OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs")


def test_every_v1_route_refuses_requests_without_the_token(stack):
    document = httpx.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    routes = [(method.upper(), path.replace("{run_id}", "some-run"))
              for path, ops in document["paths"].items() if path.startswith("/v1/") for method in ops]
    assert {("POST", "/v1/runs"), ("POST", "/v1/runs/some-run/cancel"), ("POST", "/v1/runs/some-run/resume"),
            ("GET", "/v1/runs")} <= set(routes)
    assert all(path.startswith("/v1/") or path in OPEN_PATHS for path in document["paths"]), document["paths"]
    stored = [r["id"] for r in stack.client().runs()]
    with httpx.Client(base_url=stack.api_url, timeout=30) as http:
        for method, path in routes:
            for headers in ({}, {"Authorization": WRONG.header}, {"Authorization": stack.token.secret},
                            {"Authorization": "Basic " + stack.token.secret}):
                r = http.request(method, path, headers=headers, json={})
                assert r.status_code == 401, (method, path, r.status_code, r.text)
                assert r.json() == {"detail": {"error": "missing or invalid bearer token"}}
                assert r.headers["www-authenticate"] == "Bearer"
            r = http.request(method, path, headers={"Authorization": stack.token.header}, json={})
            assert r.status_code != 401, (method, path)
        for path in OPEN_PATHS:  # probes, scrapes and the API's documentation need no token
            assert http.get(path).status_code == 200, path
    # Nothing an unauthenticated client sent was stored (the shared stack may hold other tests' runs).
    assert [r["id"] for r in stack.client().runs()] == stored


def test_the_openapi_document_declares_the_bearer_scheme(stack):
    document = httpx.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    assert document["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": "The deployment's shared token (services/common/auth.py)."}
    submit = document["paths"]["/v1/runs"]["post"]
    assert submit["security"] == [{"HTTPBearer": []}] and "401" in submit["responses"]


@pytest.mark.parametrize("service", ["trainer", "rollout", "coordinator"])
def test_a_service_without_a_token_refuses_to_start(service, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TOKEN_FILE_ENV)}
    env["PYTHONPATH"] = str(REPO_ROOT)
    base = [sys.executable, "-m", f"services.{service}"]
    base += ["--data-dir", str(tmp_path)] if service == "coordinator" else ["--grpc-port", "0", "--metrics-port", "0"]

    def start(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    proc = start()
    assert proc.returncode == 2, proc.stderr
    assert "no authentication token" in proc.stderr and TOKEN_FILE_ENV in proc.stderr
    # A token too short to be a secret is refused as well, naming where it came from, without showing it.
    short = tmp_path / "short-token"
    short.write_text("hunter2\n")
    proc = start("--auth-token-file", str(short))
    assert proc.returncode == 2 and "auth_token_file" in proc.stderr and "at least 32" in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stderr + proc.stdout
