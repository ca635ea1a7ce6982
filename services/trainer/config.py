"""Typed configuration of the trainer service (the process).

`TrainerServiceConfig` is parsed from flags/environment when the process
starts (`LOCKSTEP_TRAINER_*`). The per-run settings, `TrainerRunConfig`, are
part of the torch-free contract the coordinator shares (contract/trainer_run.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from services.common.path_roots import DEFAULT_ROOTS, RootList
from services.common.process.service_config import AuthSetting, split_host_port
from services.common.rendezvous.key_table import RendezvousLimits


class TrainerServiceConfig(AuthSetting):
    """Lockstep trainer service: gRPC server that turns trajectories into policy updates."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = Field("127.0.0.1", description="Address the gRPC and metrics servers bind to.")
    grpc_port: int = Field(50052, ge=0, le=65535, description="gRPC port (0 = pick a free one; it is logged).")
    metrics_port: int = Field(
        9102, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = no metrics server)."
    )
    device: str = Field("cpu", description="torch device the model trains on: 'cpu', 'cuda', 'cuda:1', ...")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")
    num_threads: int = Field(
        0,
        ge=0,
        description="torch CPU threads (0 = torch's default). Pinned because CPU reductions split work "
        "by thread count, so bitwise determinism holds only at a fixed count.",
    )
    attention_plugins: list[str] = Field(
        default_factory=list,
        description="Comma-separated modules imported at start-up that register extra attention backends "
        "with kernels.attention.REGISTRY (a run selects one through trainer.attention.backend).",
    )
    @field_validator("attention_plugins", mode="before")
    @classmethod
    def _split_plugins(cls, v: object) -> object:
        return [m.strip() for m in v.split(",") if m.strip()] if isinstance(v, str) else v

    data_parallel: int = Field(
        1, ge=1, le=64,
        description="Ranks on this host (FSDP): this process is rank 0 and serves gRPC, it starts the others; "
        "each holds 1/N of every float32 master weight, gradient and AdamW state and trains on its share of "
        "every step's microbatches (gradients reduce-scattered and summed). With device 'cuda', rank r uses "
        "cuda:r (NCCL); with 'cpu', gloo.",
    )
    rank_rendezvous_port: int = Field(
        0, ge=0, le=65535,
        description="With data_parallel > 1: 0 = this process starts ranks 1..N-1 on this host. A port = they "
        "are started elsewhere, one process each with devices of its own (`python -m services.trainer.distributed.rank "
        "--rank R --rendezvous <host>:<port>`; the Ray launcher places them across nodes), and meet at the "
        "rendezvous this process serves on host:port only (gRPC, the deployment's token on every call; a rank "
        "without it is refused). The collectives that follow are not authenticated: keep the port on the "
        "cluster network.",
    )
    collective_timeout_s: float = Field(
        600.0, gt=0, description="A data-parallel collective that waits longer than this fails the step.")

    @model_validator(mode="after")
    def _group_device(self) -> "TrainerServiceConfig":
        if self.data_parallel > 1 and self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} names one device; with data_parallel {self.data_parallel} "
                             "use 'cuda' (rank r takes cuda:r) or 'cpu'")
        if self.rank_rendezvous_port and self.data_parallel == 1:
            raise ValueError("rank_rendezvous_port: set, but data_parallel is 1 (no other ranks to meet)")
        return self

    def rank_rendezvous(self) -> str:
        """host:port of the store ranks started elsewhere join; empty when rank 0 starts them itself."""
        return f"{self.host}:{self.rank_rendezvous_port}" if self.rank_rendezvous_port else ""

    weight_chunk_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Default chunk size of GetWeights streams (a request may override)."
    )
    weight_broadcast_address: str = Field(
        "",
        description="host:port of this trainer's rendezvous for the broadcast weight source: from its start the "
        "trainer serves the rendezvous (gRPC, the deployment's token on every call) on this host and port only, "
        "and replicas reach it at this address (each must list it in its broadcast_sources). A name that "
        "resolves to several addresses (localhost) is served on each. Never taken from a run or a request. "
        "Empty: OpenWeightBroadcast is refused.",
    )
    weight_broadcast_max_keys: int = Field(
        RendezvousLimits.max_keys, ge=1,
        description="Keys the rendezvous holds at most, over the groups open at once (a sync's group needs "
        "about two per rank). A write past it is refused (RESOURCE_EXHAUSTED) and the sync fails.",
    )
    weight_broadcast_max_value_bytes: int = Field(
        RendezvousLimits.max_value_bytes, ge=1,
        description="Largest value the rendezvous stores (gloo's address list of a rank: about 170 bytes plus 8 "
        "per rank of the group). Messages larger than two such values are not received at all.",
    )
    weight_broadcast_max_store_bytes: int = Field(
        RendezvousLimits.max_bytes, ge=1,
        description="Bytes of keys and values the rendezvous holds at most, whoever writes them: the most a "
        "sync's ranks can make it hold. Callers without the token cannot store anything.",
    )
    weight_ipc_bucket_bytes: int = Field(
        1024 * 1024 * 1024, ge=1024,
        description="Bucket size of an IPC weight handover (rollout.weight_sync ipc): the policy is packed into "
        "shared buffers of this many bytes (a larger tensor alone), one IPC handle each; an OpenWeightHandover "
        "may ask for another. Few large buckets keep the handle count (and each mapping's cost) low.",
    )
    weight_ipc_digest: Literal["host", "device"] = Field(
        "host", description="Where an IPC handover's device buckets are hashed: 'host' copies them through pinned "
        "buffers and hashes on every core; 'device' hashes their whole 4 MiB blocks on the GPU (kernels/digest) "
        "and only each tensor's last, shorter block on the host. The same digest either way.",
    )
    weight_broadcast_bucket_bytes: int = Field(
        256 * 1024 * 1024, ge=1024,
        description="Bucket size of a weight broadcast: consecutive tensors of one dtype up to this many bytes "
        "go as one flat buffer (a larger tensor alone). Bounds the extra memory a sync takes on either side.",
    )
    weight_broadcast_timeout_s: float = Field(
        300.0, gt=0, description="A weight broadcast whose ranks do not all join, or whose bucket does not "
        "arrive, within this long fails (ABORTED); the replicas apply nothing of it.")

    @field_validator("weight_broadcast_address")
    @classmethod
    def _broadcast_host_port(cls, v: str) -> str:
        if v:
            split_host_port(v, "weight_broadcast_address")
        return v

    def rendezvous_limits(self) -> RendezvousLimits:
        return RendezvousLimits(max_keys=self.weight_broadcast_max_keys,
                                max_value_bytes=self.weight_broadcast_max_value_bytes,
                                max_bytes=self.weight_broadcast_max_store_bytes)

    shutdown_grace_s: float = Field(
        5.0, ge=0, description="Seconds in-flight RPCs get to finish after SIGTERM before they are cancelled."
    )
    model_roots: RootList = Field(
        default_factory=lambda: list(DEFAULT_ROOTS),
        description="Comma-separated directories ConfigureRun's model_path must resolve inside (INVALID_ARGUMENT "
        "otherwise). '/' is not accepted. Default: runs (relative to the working directory).",
    )
    checkpoint_roots: RootList = Field(
        default_factory=lambda: list(DEFAULT_ROOTS),
        description="Comma-separated directories checkpoints are written to and read from (SaveCheckpoint, "
        "LoadCheckpoint, ConfigureRun's resume_checkpoint); INVALID_ARGUMENT for any other. Default: runs.",
    )
