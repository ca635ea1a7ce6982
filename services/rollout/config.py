"""Typed configuration of the rollout service process (flags and environment).

Run-level engine options (dtype, device, batch size) are not here: they arrive
with each LoadModel as `engine_config_json` and are validated by the engine's
own options model (e.g. contract.engine_options.TorchEngineConfig).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from services.common.path_roots import DEFAULT_ROOTS, RootList
from services.common.process.service_config import AuthSetting, split_host_port

ENV_PREFIX = "LOCKSTEP_ROLLOUT"
REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON_ENV = "LOCKSTEP_SGLANG_PYTHON"
"""Environment default for `sglang_python`: the interpreter of the SGLang virtualenv."""
SGLANG_WEIGHTS_DIR_ENV = "LOCKSTEP_SGLANG_WEIGHTS_DIR"
"""Environment default for `sglang_weights_dir`: where synced checkpoints are written."""


def default_sglang_python() -> str:
    return os.environ.get(SGLANG_PYTHON_ENV) or str(REPO_ROOT / ".venv-sglang" / "bin" / "python")


def default_sglang_weights_dir() -> str:
    return os.environ.get(SGLANG_WEIGHTS_DIR_ENV) or str(REPO_ROOT / "runs" / "sglang-weights")


class RolloutServiceConfig(AuthSetting):
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
    role: Literal["policy", "scorer"] = Field(
        "policy",
        description="'policy': generates the run's rollouts (Generate) and follows the trainer's weights. 'scorer': "
        "serves a reward model (engine reward_model) or a generative judge (engine torch or sglang) through Score "
        "(docs/rewards.md); it refuses Generate and every weight update, and a policy replica refuses Score.",
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
    model_roots: RootList = Field(
        default_factory=lambda: list(DEFAULT_ROOTS),
        description="Comma-separated directories LoadModel's model_path must resolve inside (INVALID_ARGUMENT "
        "otherwise). '/' is not accepted. Default: runs (relative to the working directory).",
    )
    weight_sources: list[str] = Field(
        default_factory=list,
        description="Comma-separated host:port of the trainers SyncWeights may pull weights from (with this "
        "service's bearer token); a SyncWeights naming any other address is refused, so no caller can point the "
        "replica at a server of its choosing. Empty: SyncWeights is refused.",
    )

    broadcast_sources: list[str] = Field(
        default_factory=list,
        description="Comma-separated host:port of the trainer rendezvous (their weight_broadcast_address) "
        "ReceiveWeights may join a weight-update group at; a plan naming any other address is refused, so no "
        "caller can make the replica connect where it chooses. Empty: ReceiveWeights is refused.",
    )
    weight_ipc_digest: Literal["host", "device"] = Field(
        "host", description="Where MapWeights hashes the buckets it mapped from the trainer's GPU: 'host' copies "
        "them through pinned buffers and hashes on every core; 'device' hashes their whole 4 MiB blocks on the GPU "
        "(kernels/digest) and only each tensor's last, shorter block on the host. The same digest either way.")
    weight_broadcast_timeout_s: float = Field(
        300.0, gt=0, description="ReceiveWeights fails (nothing applied) when the group does not form or a "
        "bucket does not arrive within this long.")

    @field_validator("weight_sources", "broadcast_sources", mode="before")
    @classmethod
    def _split_sources(cls, v: object) -> object:
        return [a.strip() for a in v.split(",") if a.strip()] if isinstance(v, str) else v

    @field_validator("weight_sources", "broadcast_sources")
    @classmethod
    def _host_port(cls, v: list[str], info) -> list[str]:
        for i, address in enumerate(v):
            split_host_port(address, f"{info.field_name}[{i}]")
        return v

    # What the SGLang engine executes and where it writes belong to the operator, never to a run:
    # a LoadModel's engine_config_json cannot set any of these.
    sglang_python: str = Field(
        default_factory=default_sglang_python,
        description="Interpreter of the SGLang virtualenv (deploy/sglang/setup_cpu_venv.sh builds one); SGLang is "
        f"never imported into the rollout service's own environment. Default: ${SGLANG_PYTHON_ENV} or .venv-sglang.",
    )
    sglang_weights_dir: str = Field(
        default_factory=default_sglang_weights_dir,
        description="Directory where the SGLang engine writes each synced policy version as a Hugging Face "
        "checkpoint for /update_weights_from_disk (and from which a restarted server reloads), and the server "
        f"logs. Default: ${SGLANG_WEIGHTS_DIR_ENV} or runs/sglang-weights.",
    )
    sglang_url: str = Field(
        "",
        description="Attach to an already running SGLang server at this base URL instead of launching one "
        "(needs sglang_api_key_file). Empty: every LoadModel with engine sglang launches its own server.",
    )
    sglang_api_key_file: str = Field(
        "",
        description="File holding the --api-key of the server at sglang_url. Servers the engine launches get a "
        "generated key instead.",
    )
    sglang_host: str = Field(
        "127.0.0.1",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9.:-]*$",
        description="Address the SGLang servers the engine launches bind to (loopback by default; 0.0.0.0 in a "
        "container whose Prometheus scrapes them). A run cannot choose it.",
    )
    sglang_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the SGLang server the engine launches (0 = a free port picked at each launch; "
        "compose: 30000, Prometheus' target). A run cannot choose it.",
    )
    sglang_extra_args: list[str] = Field(
        default_factory=list,
        description="More SGLang server flags, appended last (space-separated). For what the typed engine "
        "options don't cover; the platform's own decisions stay in services.common.platform.",
    )

    @field_validator("sglang_extra_args", mode="before")
    @classmethod
    def _split_args(cls, v: object) -> object:
        return v.split() if isinstance(v, str) else v
