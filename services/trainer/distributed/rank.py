"""`python -m services.trainer.distributed.rank`: one worker rank (1..N-1) of a multi-rank trainer, started apart from
rank 0 (the Ray launcher places each as an actor, on any node). It serves nothing: it joins rank 0's
rendezvous at --rendezvous with the deployment's token (as every service loads it; without one it does
not start, and a token rank 0 refuses stops it with exit status 1, naming the refusal), takes the
group's spec from there, and runs what rank 0 broadcasts until rank 0 stops the group. It exits with 70
when the group loses a rank (its supervisor restarts it, and it joins rank 0's next store)."""
from __future__ import annotations

import sys

from pydantic import ConfigDict, Field, field_validator

from services.common.auth import load_token_or_exit
from services.common.process.service_config import AuthSetting, parse_service_config, split_host_port


class TrainerRankConfig(AuthSetting):
    """A worker rank of a multi-rank trainer (rank 0 is `python -m services.trainer`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rank: int = Field(..., ge=1, le=1023, description="This process's rank in the group (rank 0 serves gRPC).")
    rendezvous: str = Field(
        ..., description="host:port of rank 0's rendezvous: its --host and --rank-rendezvous-port.")
    host: str = Field("", description="Address of this rank's node (logged; the launcher passes it).")
    attention_plugins: list[str] = Field(
        default_factory=list,
        description="Comma-separated modules this rank may import because rank 0's group names them (rank 0's "
        "--attention-plugins). A module rank 0's spec names that is not listed here is refused, nothing "
        "imported.",
    )
    join_timeout_s: float = Field(
        600.0, gt=0, description="How long to wait for rank 0 to serve a fresh store before exiting non-zero.")

    @field_validator("attention_plugins", mode="before")
    @classmethod
    def _split_plugins(cls, v: object) -> object:
        return [m.strip() for m in v.split(",") if m.strip()] if isinstance(v, str) else v

    @field_validator("rendezvous")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_host_port(v, "rendezvous")
        return v


def main(argv: list[str] | None = None) -> int:
    config = parse_service_config(TrainerRankConfig, env_prefix="LOCKSTEP_TRAINER_RANK", argv=argv)
    token = load_token_or_exit(config.auth_token_file)
    from services.trainer.distributed.rank_rendezvous import RendezvousRefused
    # torch and the model code load here, after the flags are checked.
    from services.trainer.distributed.worker_group import run_rank

    try:
        run_rank(config.rank, config.rendezvous, token, config.join_timeout_s, tuple(config.attention_plugins))
    except RendezvousRefused as exc:
        print(f"trainer rank {config.rank}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
