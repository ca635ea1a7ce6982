"""Typed service configuration from flags and environment.

Each service owns a pydantic model whose fields carry their own docs
(`Field(description=...)`). `parse_service_config` turns that model into
command-line flags (`--grpc-port`) and environment variables
(`LOCKSTEP_ROLLOUT_GRPC_PORT`); precedence is flag > environment > default.
Validation errors name the field and exit non-zero before anything starts.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import TypeVar

from pydantic import BaseModel, Field, ValidationError


def split_host_port(address: str, field: str) -> tuple[str, int]:
    """`address` as (host, port); ValueError naming `field` unless it is host:port with a port in 1..65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{field}: {address!r} is not host:port")
    return host, int(port)


class AuthSetting(BaseModel):
    """The setting every service's configuration shares: where its copy of the deployment's token is
    (services/common/auth.py loads and checks it)."""

    auth_token_file: str = Field(
        "",
        description="File holding the deployment's shared bearer token, required on every call. Empty: "
        "$LOCKSTEP_AUTH_TOKEN_FILE, else $LOCKSTEP_AUTH_TOKEN; with none of them the service refuses to start "
        "(`python -m services.common.auth FILE` writes a token).",
    )


ConfigT = TypeVar("ConfigT", bound=BaseModel)


def env_var(prefix: str, field: str) -> str:
    return f"{prefix}_{field}".upper()


def parse_service_config(
    model: type[ConfigT],
    *,
    env_prefix: str,
    argv: list[str] | None = None,
    description: str | None = None,
) -> ConfigT:
    parser = argparse.ArgumentParser(description=description or model.__doc__)
    for name, field in model.model_fields.items():
        env = env_var(env_prefix, name)
        default = field.default if field.default_factory is None else field.default_factory()
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            help=f"{field.description or ''} [env {env}; default {default!r}]",
        )
    args = parser.parse_args(argv)
    values: dict[str, object] = {}
    for name in model.model_fields:
        flag = getattr(args, name)
        if flag is not None:
            values[name] = flag
        elif (env := os.environ.get(env_var(env_prefix, name))) is not None:
            values[name] = env
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            print(f"configuration error: {loc}: {err['msg']}", file=sys.stderr)
        raise SystemExit(2) from None
