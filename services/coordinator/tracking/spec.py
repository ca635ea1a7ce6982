"""The run spec's `samples` and `tracking` sections (docs/tracking.md).

Where a tracker writes is not the spec's to say: offline files go under the run's directory, and any
server or directory outside it is the coordinator operator's configuration (CoordinatorConfig's
tracking_* settings). A spec names which trackers to log to and how often to log samples.
"""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

TRACKER_PACKAGES = {
    "wandb": (("wandb",), "'wandb==0.31.0'"),
    "tensorboard": (("tensorboard",), "'tensorboard==2.21.0'"),
    # SQLAlchemy and alembic: MLflow's local sqlite store, the default (its file store is retired).
    "mlflow": (("mlflow", "sqlalchemy", "alembic"), "'mlflow-skinny==3.18.0' 'SQLAlchemy==2.1.9' 'alembic==1.20.1'"),
}
"""Tracker name -> (modules it imports, what to pip install: the versions requirements.lock pins)."""


def install_hint(tracker: str) -> str:
    modules, packages = TRACKER_PACKAGES[tracker]
    return f"tracker {tracker!r} needs {', '.join(modules)}: pip install {packages} (pinned in requirements.lock)"


def tracker_installed(tracker: str) -> bool:
    """Whether the tracker's packages can be imported, without importing them."""
    return all(importlib.util.find_spec(m) is not None for m in TRACKER_PACKAGES[tracker][0])


class SamplesSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_steps: int = Field(1000, ge=0, le=1_000_000, description="Keep every sample of the last N steps (prompt, "
                            "response, token ids, reward, advantage, IW range, ...) under <run dir>/samples/, for "
                            "GET /v1/runs/{id}/steps/{s}/samples and `lockstep samples`; 0 keeps none.")
    keep_mib: int = Field(1024, ge=1, le=65536, description="And at most this many MiB of them: the oldest kept "
                          "steps go first (the newest step is always kept).")


class TrackingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backends: list[Literal["wandb", "tensorboard", "mlflow"]] = Field(
        default_factory=list, max_length=3, description="Experiment trackers the coordinator logs the run to: every "
        "step metric under its Prometheus name, the spec as config, the platform fingerprint, eval results and a "
        "samples table. Each is imported only when named; a tracker that fails never fails or slows the run "
        "(counted in lockstep_tracking_failures_total).")
    project: str = Field("lockstep", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
                         description="W&B project and MLflow experiment name; TensorBoard ignores it.")
    samples_every: int = Field(10, ge=0, le=1_000_000, description="Log a table of the step's samples every N steps "
                               "(and at the last); 0 = never. Needs samples.keep_steps > 0.")
    samples_rows: int = Field(8, ge=1, le=256, description="Rows of that table: the step's first samples.")

    @field_validator("backends")
    @classmethod
    def _installed_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"{v}: a tracker is named twice")
        for name in v:
            if not tracker_installed(name):
                raise ValueError(install_hint(name))
        return v
