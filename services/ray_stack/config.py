"""Configuration of a Lockstep stack placed on a Ray cluster (`python -m services.ray_stack`)."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RayStackConfig(BaseModel):
    """Lockstep on Ray: the trainer, rollout replicas and coordinator as supervised Ray actors.

    Every node of the cluster needs the Lockstep environment (the image or the
    virtualenv) at the same path, and the model and data directories on
    storage all nodes see: run specs name the model by path, and the trainer
    writes the checkpoints the coordinator points it to.
    """

    model_config = ConfigDict(extra="forbid")

    ray_address: str = Field(
        "auto",
        description="Ray cluster to join: 'auto' (the cluster this machine belongs to, as `ray start` left it), "
        "host:port of the head's GCS, or 'local' (start a one-machine cluster in this process).",
    )
    namespace: str = Field(
        "lockstep", description="Ray namespace of the stack's named actors ('trainer', 'rollout-0', ... 'coordinator')."
    )
    rollout_replicas: int = Field(1, ge=1, description="Rollout replicas (one Ray actor and one service each).")
    trainer_gpus: float = Field(0, ge=0, description="GPUs reserved for the trainer (Ray sets its CUDA/HIP_VISIBLE_DEVICES).")
    rollout_gpus: float = Field(0, ge=0, description="GPUs reserved for each rollout replica.")
    trainer_cpus: float = Field(1, gt=0, description="CPUs reserved for the trainer.")
    rollout_cpus: float = Field(1, gt=0, description="CPUs reserved for each rollout replica.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement-group strategy over the trainer and rollout bundles: PACK fills one node "
        "first, SPREAD puts services on different nodes where it can, STRICT_* insist.",
    )
    coordinator_port: int = Field(8000, ge=1, le=65535, description="REST API port of the coordinator.")
    trainer_port: int = Field(50052, ge=1, le=65535, description="gRPC port of the trainer.")
    trainer_metrics_port: int = Field(9102, ge=0, le=65535, description="Trainer /metrics port (0 = none).")
    trainer_broadcast_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the trainer's rendezvous for the broadcast weight source (rollout.weight_sync: "
        "broadcast): the trainer serves it there, on its node's address only and to callers with the token, "
        "gets --weight-broadcast-address <its node's address>:<port>, and every rollout replica gets that "
        "address as its --broadcast-sources. 0 = no broadcast source (a broadcast run then fails at its first "
        "sync). The collective traffic is not authenticated: keep the port on the cluster network.",
    )
    rollout_port_base: int = Field(
        50061, ge=1, le=65535,
        description="gRPC port of rollout replica i is rollout_port_base + i. Ports are fixed, not picked at "
        "start, so a service restarted by its supervisor (or an actor restarted by Ray, which stays in its "
        "placement-group bundle and so on its node) keeps the address the coordinator dials.",
    )
    rollout_metrics_port_base: int = Field(
        9111, ge=0, le=65535, description="Rollout replica i's /metrics port is this + i (0 = none)."
    )
    data_dir: str = Field(
        "runs", description="Coordinator data directory (run directories, checkpoints, embedded Redis); on shared "
        "storage, since the trainer writes checkpoints into it."
    )
    redis_url: str = Field("", description="Redis for run state; empty = the coordinator's embedded Redis.")
    path_roots: list[str] = Field(
        default_factory=list,
        description="Comma-separated directories (on storage every node sees) that models and datasets may come "
        "from, besides data_dir: the services' model_roots and data_roots. Checkpoints stay under data_dir.",
    )
    auth_token_file: str = Field(
        "",
        description="File holding the stack's bearer token, on storage every node sees. Empty: data_dir/auth_token, "
        "generated (mode 0600) at the first start and reused after. Every service reads it; clients (the "
        "`lockstep` CLI: --token-file) send it.",
    )
    num_threads: int = Field(1, ge=0, description="torch CPU threads of the trainer and rollout services (0 = torch's default).")
    trainer_args: list[str] = Field(
        default_factory=list, description="Extra flags for `python -m services.trainer` (shell-quoted string), e.g. '--device cuda'."
    )
    rollout_args: list[str] = Field(default_factory=list, description="Extra flags for `python -m services.rollout`.")
    coordinator_args: list[str] = Field(default_factory=list, description="Extra flags for `python -m services.coordinator`.")
    service_restarts: int = Field(
        10, ge=0,
        description="Times a supervisor restarts its service after it exits on its own (like compose's "
        "restart policy); Ray restarts a dead actor as often again.",
    )
    restart_delay_s: float = Field(1.0, ge=0, description="Pause before a supervisor restarts its service.")
    ready_timeout_s: float = Field(300.0, gt=0, description="How long start-up waits for every service to answer.")

    @field_validator("trainer_args", "rollout_args", "coordinator_args", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("path_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    def roots(self) -> str:
        """The services' roots flag value: data_dir and path_roots, resolved."""
        return ",".join(str(Path(p).resolve()) for p in (self.data_dir, *self.path_roots))

    def token_path(self) -> Path:
        return Path(self.auth_token_file or Path(self.data_dir) / "auth_token").resolve()

    @model_validator(mode="after")
    def _ports_distinct(self) -> RayStackConfig:
        ports = {"coordinator_port": [self.coordinator_port], "trainer_port": [self.trainer_port],
                 "trainer_metrics_port": [self.trainer_metrics_port] if self.trainer_metrics_port else [],
                 "trainer_broadcast_port": [self.trainer_broadcast_port] if self.trainer_broadcast_port else [],
                 "rollout_port_base": [self.rollout_port_base + i for i in range(self.rollout_replicas)],
                 "rollout_metrics_port_base": [self.rollout_metrics_port_base + i for i in range(self.rollout_replicas)]
                 if self.rollout_metrics_port_base else []}
        seen: dict[int, str] = {}
        for name, values in ports.items():
            for p in values:
                if p > 65535:
                    raise ValueError(f"{name}: port {p} of replica {p - values[0]} is above 65535")
                if p in seen:
                    raise ValueError(f"{name}: port {p} is also {seen[p]}'s (services may share a node)")
                seen[p] = name
        return self

    @model_validator(mode="after")
    def _broadcast_flags_are_the_launchers(self) -> RayStackConfig:
        # With the port set the launcher passes these flags itself; a second value in the extra args would
        # silently win or lose by its position on the command line.
        if self.trainer_broadcast_port:
            launchers = (("trainer_args", "--weight-broadcast-address"), ("rollout_args", "--broadcast-sources"))
            for field, flag in launchers:
                if any(a == flag or a.startswith(f"{flag}=") for a in getattr(self, field)):
                    raise ValueError(f"{field}: {flag} is set by the launcher from trainer_broadcast_port "
                                     f"({self.trainer_broadcast_port}); drop it from {field}")
        return self
