"""Configuration of a Lockstep stack placed on a Ray cluster (`python -m services.ray_stack`)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# The variables trainer_env may set: the collective libraries' own, nothing that picks code to run.
COLLECTIVE_ENV = re.compile(r"(NCCL|GLOO|TORCH_NCCL)_[A-Z0-9_]+")
# Flags of the trainer the launcher sets itself for a multi-rank trainer.
GROUP_FLAGS = ("--device", "--data-parallel", "--rank-rendezvous-port")


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
    trainer_gpus: float = Field(
        0, ge=0, description="GPUs reserved for a one-rank trainer (Ray sets its CUDA/HIP_VISIBLE_DEVICES); with "
        "trainer_world_size > 1 use trainer_gpus_per_rank.")
    trainer_world_size: int = Field(
        1, ge=1, le=1024,
        description="Ranks of the FSDP trainer, each a Ray actor in one bundle of the trainer's placement group "
        "(trainer_placement_strategy). Rank 0 ('trainer') serves gRPC on trainer_port and the ranks' store on "
        "trainer_rendezvous_port of its node; ranks 1..N-1 ('trainer-rank-<r>', `python -m "
        "services.trainer.distributed.rank`) join there, from any node. Backend gloo on CPU, nccl with GPUs.",
    )
    trainer_gpus_per_rank: float = Field(
        0, ge=0,
        description="GPUs of each trainer rank's bundle. With trainer_world_size > 1, 0: the ranks train on CPU "
        "(gloo); more: on CUDA (nccl; rccl on ROCm), each rank on the first GPU Ray gives it, so 1 is what FSDP "
        "uses. A one-rank trainer takes its device from trainer_args ('--device cuda') as before.",
    )
    trainer_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement-group strategy over the trainer ranks' bundles: PACK fills a node before the "
        "next (NVLink within a node, the network between), STRICT_PACK insists on one node, SPREAD / "
        "STRICT_SPREAD put ranks on different nodes.",
    )
    trainer_rendezvous_port: int = Field(
        0, ge=0, le=65535,
        description="Port of the ranks' rendezvous on rank 0's node (required with trainer_world_size > 1): gRPC "
        "on that node's address only, the stack's token on every call; the other ranks dial it there. The "
        "collectives that follow are not authenticated: keep the port on the cluster network.",
    )
    trainer_env: list[str] = Field(
        default_factory=list,
        description="NAME=VALUE settings (shell-quoted string) every trainer rank gets on top of its node's "
        "environment, for the collective libraries only (NCCL_*, GLOO_*, TORCH_NCCL_*), e.g. "
        "'NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0 NCCL_IB_HCA=mlx5'. NCCL_NVLS_ENABLE=0 (NVLink "
        "multicast off) is added unless named here. What `ray start` exported on a node passes through too.",
    )
    rollout_gpus: float = Field(0, ge=0, description="GPUs reserved for each rollout replica.")
    trainer_cpus: float = Field(1, gt=0, description="CPUs reserved for each trainer rank.")
    rollout_cpus: float = Field(1, gt=0, description="CPUs reserved for each rollout replica.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement-group strategy over the rollout replicas' bundles: PACK fills one node "
        "first, SPREAD puts replicas on different nodes where it can, STRICT_* insist. The trainer's ranks "
        "have a placement group of their own (trainer_placement_strategy).",
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

    @field_validator("trainer_args", "rollout_args", "coordinator_args", "trainer_env", mode="before")
    @classmethod
    def _split(cls, v: object) -> object:
        return shlex.split(v) if isinstance(v, str) else v

    @field_validator("path_roots", mode="before")
    @classmethod
    def _split_roots(cls, v: object) -> object:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("trainer_env")
    @classmethod
    def _collective_env(cls, v: list[str]) -> list[str]:
        for item in v:
            name, sep, _ = item.partition("=")
            if not sep or not COLLECTIVE_ENV.fullmatch(name):
                raise ValueError(f"{item!r} is not NAME=VALUE with NAME a NCCL_*, GLOO_* or TORCH_NCCL_* variable")
        return v

    def rank_env(self) -> dict[str, str]:
        """What every trainer rank's process gets on top of its node's environment."""
        return {"NCCL_NVLS_ENABLE": "0", **dict(item.split("=", 1) for item in self.trainer_env)}

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
                 "trainer_rendezvous_port": [self.trainer_rendezvous_port] if self.trainer_rendezvous_port else [],
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

    @model_validator(mode="after")
    def _trainer_group(self) -> RayStackConfig:
        if self.trainer_world_size == 1:
            if self.trainer_gpus and self.trainer_gpus_per_rank:
                raise ValueError("trainer_gpus_per_rank: set with trainer_gpus too; give one of them")
            return self
        if not self.trainer_rendezvous_port:
            raise ValueError(f"trainer_rendezvous_port: required with trainer_world_size {self.trainer_world_size}")
        if self.trainer_gpus:
            raise ValueError("trainer_gpus: with trainer_world_size > 1 give trainer_gpus_per_rank instead")
        for flag in GROUP_FLAGS:
            if any(a == flag or a.startswith(f"{flag}=") for a in self.trainer_args):
                raise ValueError(f"trainer_args: {flag} is set by the launcher for trainer_world_size "
                                 f"{self.trainer_world_size}; drop it from trainer_args")
        return self

    def trainer_rank_gpus(self) -> float:
        return self.trainer_gpus_per_rank or self.trainer_gpus
