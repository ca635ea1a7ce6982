"""Options of the SGLang engine (LoadModelRequest.engine_config_json with engine=sglang)."""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.common.platform import SGLangPlatformConfig
from services.rollout.config import (
    SGLANG_PYTHON_ENV,
    SGLANG_WEIGHTS_DIR_ENV,
    RolloutServiceConfig,
    default_sglang_python,
    default_sglang_weights_dir,
)
from services.rollout.engine import parse_engine_config

# The service-owned defaults live with the rollout service's config; re-exported for callers here.
PYTHON_ENV, WEIGHTS_DIR_ENV = SGLANG_PYTHON_ENV, SGLANG_WEIGHTS_DIR_ENV
default_python, default_weights_dir = default_sglang_python, default_sglang_weights_dir

SERVICE_OWNED_OPTIONS: dict[str, str] = {
    "python": "sglang_python",
    "weights_dir": "sglang_weights_dir",
    "log_dir": "sglang_weights_dir",
    "url": "sglang_url",
    "extra_args": "sglang_extra_args",
}
"""Options a run may not set (they choose an executable, a server to talk to, or where files are written),
with the rollout service setting that decides each instead."""


class SGLangHostConfig(BaseModel):
    """What the rollout service's operator decides for every SGLang engine; a run cannot set any of it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    python: str = Field(default_factory=default_sglang_python, description="Interpreter of the SGLang virtualenv.")
    weights_dir: str = Field(
        default_factory=default_sglang_weights_dir,
        description="Where synced policy versions (and the server logs) are written, one directory per engine.",
    )
    url: str = Field("", description="Base URL of an already running server to attach to; empty: launch one.")
    api_key: SecretStr | None = Field(None, description="The --api-key of the server at url (launched servers get a generated one).")
    extra_args: tuple[str, ...] = Field((), description="More server flags, appended last.")

    @classmethod
    def from_service(cls, config: RolloutServiceConfig) -> "SGLangHostConfig":
        api_key = None
        if config.sglang_api_key_file:
            try:
                api_key = SecretStr(Path(config.sglang_api_key_file).read_text().strip())
            except OSError as exc:
                raise ValueError(f"sglang_api_key_file: cannot read it: {exc.strerror or exc}") from None
        return cls(python=config.sglang_python, weights_dir=config.sglang_weights_dir, url=config.sglang_url,
                   api_key=api_key, extra_args=tuple(config.sglang_extra_args))


def service_owned_reason(option: str) -> str:
    return (f"{option}: set by the rollout service's configuration ({SERVICE_OWNED_OPTIONS[option]}), "
            "not by a run: it chooses what runs on the host or where files are written")


class SGLangEngineConfig(BaseModel):
    """How a run wants its SGLang server: platform, parallelism, timeouts (see SGLangHostConfig for the rest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", min_length=1, description="Address the launched server binds to.")
    port: int = Field(0, ge=0, le=65535, description="Port of the launched server (0 = a free port picked at launch).")
    platform: str = Field(
        "auto",
        description="'auto' (detect: services.common.platform.probe_platform), 'cpu', 'cuda' or 'rocm'.",
    )
    server: SGLangPlatformConfig = Field(
        default_factory=SGLangPlatformConfig,
        description="Platform-dependent server options (attention backend on CUDA, deterministic mode, dtype, ...).",
    )
    tp_size: int = Field(1, ge=1, description="Tensor-parallel degree of the server (--tp-size).")
    keep_versions: int = Field(
        2, ge=1, description="Synced checkpoints kept on disk (the current one always among them)."
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a launched server gets to answer /health (CPU start-up is 20-90 s)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Seconds one /generate call may take before the server is considered lost."
    )
    weight_update_timeout_s: float = Field(600.0, gt=0, description="Seconds /update_weights_from_disk may take.")
    max_restarts: int = Field(
        3, ge=0, description="Consecutive failed restarts after which the engine stops trying and stays unavailable."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_service_options(cls, data: object) -> object:
        if isinstance(data, dict):
            for key in sorted(set(data) & set(SERVICE_OWNED_OPTIONS)):
                raise ValueError(service_owned_reason(key))
        return data

    @field_validator("platform")
    @classmethod
    def _known_platform(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "rocm"):
            raise ValueError(f"unknown platform {v!r}; expected auto, cpu, cuda or rocm")
        return v

    @classmethod
    def from_json(cls, text: str) -> "SGLangEngineConfig":
        """Parse and validate; errors are ValueError naming the field (`engine_config.server.dtype: ...`)."""
        return parse_engine_config(cls, text)
