"""What the rollout service decides for every SGLang engine (SGLangHostConfig), and its defaults.

A run's own SGLang options, SGLangEngineConfig, are in the torch-free contract
(contract/engine_options.py): the coordinator validates them at submit time.
"""
from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.rollout.config import (
    SGLANG_PYTHON_ENV,
    SGLANG_WEIGHTS_DIR_ENV,
    RolloutServiceConfig,
    default_sglang_python,
    default_sglang_weights_dir,
)

# The service-owned defaults live with the rollout service's config; re-exported for callers here.
PYTHON_ENV, WEIGHTS_DIR_ENV = SGLANG_PYTHON_ENV, SGLANG_WEIGHTS_DIR_ENV
default_python, default_weights_dir = default_sglang_python, default_sglang_weights_dir

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
    server_host: str = Field("127.0.0.1", min_length=1, description="Address launched servers bind to.")
    server_port: int = Field(0, ge=0, le=65535,
                             description="Port of launched servers (0 = a free port at each launch).")
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
                   api_key=api_key, server_host=config.sglang_host, server_port=config.sglang_port,
                   extra_args=tuple(config.sglang_extra_args))
