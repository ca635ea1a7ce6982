"""Options of the SGLang engine (LoadModelRequest.engine_config_json with engine=sglang)."""
from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.common.platform import SGLangPlatformConfig
from services.rollout.engine import parse_engine_config

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_ENV = "LOCKSTEP_SGLANG_PYTHON"
"""Environment default for `python`: the interpreter of the SGLang virtualenv."""
WEIGHTS_DIR_ENV = "LOCKSTEP_SGLANG_WEIGHTS_DIR"
"""Environment default for `weights_dir`: where synced checkpoints are written."""


def default_python() -> str:
    return os.environ.get(PYTHON_ENV) or str(REPO_ROOT / ".venv-sglang" / "bin" / "python")


def default_weights_dir() -> str:
    return os.environ.get(WEIGHTS_DIR_ENV) or str(REPO_ROOT / "runs" / "sglang-weights")


class SGLangEngineConfig(BaseModel):
    """How the rollout service runs (or reaches) its SGLang server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str | None = Field(
        None,
        description="Attach to an already running server at this base URL instead of launching one. "
        "Nothing is restarted then: a lost server stays an error (UNAVAILABLE) until it answers again.",
    )
    python: str = Field(
        default_factory=default_python,
        description="Interpreter of the SGLang virtualenv (deploy/sglang/setup_cpu_venv.sh builds one). SGLang is "
        f"never imported into the rollout service's own environment. Default: ${PYTHON_ENV} or .venv-sglang.",
    )
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
    extra_args: list[str] = Field(
        default_factory=list,
        description="More server flags, appended last. For what the typed options don't cover; the platform's "
        "own decisions stay in services.common.platform.",
    )
    weights_dir: str = Field(
        default_factory=default_weights_dir,
        description="Shared directory where update_weights writes each policy version as a Hugging Face "
        "checkpoint for /update_weights_from_disk (and from which a restarted server reloads). "
        f"Default: ${WEIGHTS_DIR_ENV} or runs/sglang-weights.",
    )
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
    log_dir: str | None = Field(
        None,
        description="Where the server's stdout/stderr go (sglang-<pid>.log); None = a directory under weights_dir.",
    )

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
