"""Typed configuration of the rollout service process (flags and environment).

Run-level engine options (dtype, device, batch size) are not here: they arrive
with each LoadModel as `engine_config_json` and are validated by the engine's
own config (e.g. services.rollout.torch_config.TorchEngineConfig).
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ENV_PREFIX = "LOCKSTEP_ROLLOUT"


class RolloutServiceConfig(BaseModel):
    """Lockstep rollout service: gRPC Generate / LoadModel / UpdateWeights over one engine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        "127.0.0.1",
        description="Address the gRPC and metrics servers bind to (loopback by default; "
        "set 0.0.0.0 inside a container).",
    )
    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = let the OS pick; the bound port is logged).")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = no metrics server).")
    engine: str = Field(
        "torch",
        min_length=1,
        description="Engine used when a LoadModel request does not name one in engine_config_json "
        "(see services.rollout.registry.ENGINES).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level of the JSON logs.")
    num_threads: int = Field(
        1,
        ge=0,
        description="torch intra-op threads (0 = torch's default). Pinned because CPU reductions split "
        "work by thread, so the count is part of what makes same inputs give the same bits.",
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, description="On SIGTERM, seconds in-flight RPCs get to finish before they are cancelled."
    )
