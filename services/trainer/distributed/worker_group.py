"""A multi-rank (FSDP) trainer: the serving process is rank 0; ranks 1..N-1 run `run_rank`.

Where ranks 1..N-1 run: on this host, started by rank 0 as processes (the default), or anywhere,
started by someone else (`python -m services.trainer.distributed.rank`; the Ray launcher places them as actors
across nodes). Either way they meet at rank 0's rendezvous (services/trainer/distributed/rank_rendezvous.py: gRPC,
the deployment's token on every call), read the group's spec from it, and run the same loop below.

Rank 0 answers every RPC. Every rank holds 1/N of each master weight, so
whatever touches the weights (ConfigureRun, TrainStep, CheckParity,
GetWeights, SaveCheckpoint, LoadCheckpoint, digests) is broadcast to every
rank first and executed by all of them in the same order (each is a sequence
of collectives); each rank then reports (ok, error) and rank 0 compares: a
rank that failed where rank 0 did not leaves the shards out of step, so the
group is marked broken and refuses everything after (fail closed). Info
runs on rank 0 alone.

A rank that dies takes the group down: rank 0 exits with WORKER_LOST_EXIT and
the other ranks exit with it (each learns of the loss from its liveness
connection, or from a collective that fails). A group missing a rank cannot
step; the supervisors restarting the ranks plus the coordinator resuming the
run from its last checkpoint is the recovery.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
from dataclasses import asdict, dataclass

import torch.distributed as dist

from services.common.auth import BearerToken, generate_token
from services.common.process.ports import free_port
from services.trainer.distributed import sharding
from services.trainer.distributed.data_parallel import DataParallel
from services.trainer.distributed.rank_rendezvous import (
    LIVENESS_KEY, LivenessHub, LivenessLink, join_store, serve_store, split_address,
)
from services.trainer.trainer import Trainer

log = logging.getLogger("lockstep.trainer.group")
WORKER_LOST_EXIT = 70
# What rank 0 broadcasts: the Trainer methods every rank must run (collectives over the shards).
REPLICATED = ("configure", "train_step", "check_parity", "weight_tensors", "save_checkpoint", "load_checkpoint",
              "weights_digest", "master_state_dict")


@dataclass(frozen=True)
class GroupSpec:
    world_size: int
    device: str          # 'cpu' or 'cuda'
    num_threads: int
    timeout_s: float     # collective timeout: a rank stuck longer fails the step
    log_level: str = "info"
    attention_plugins: tuple[str, ...] = ()  # imported by every rank, as the service imports them
    rendezvous: str = ""
    """host:port of rank 0's rendezvous (gRPC, that host only). Empty: rank 0 starts ranks 1..N-1 on its
    host and they meet at a free port of 127.0.0.1. Set: ranks 1..N-1 are started elsewhere, one per
    process with devices of its own (each sees its GPU as cuda:0), and join there."""

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def ranks_elsewhere(self) -> bool:
        return bool(self.rendezvous)

    def rank_device(self, rank: int) -> str:
        if self.device != "cuda":
            return "cpu"
        return "cuda:0" if self.ranks_elsewhere else f"cuda:{rank}"

    def as_dict(self) -> dict:
        return {**asdict(self), "attention_plugins": list(self.attention_plugins)}

    @classmethod
    def from_dict(cls, d: dict) -> "GroupSpec":
        return cls(**{**d, "attention_plugins": tuple(d["attention_plugins"])})


def _lost_exit(who: str) -> None:
    log.critical("trainer worker lost: %s; exiting so the group is restarted and the run resumed", who)
    logging.shutdown()
    os._exit(WORKER_LOST_EXIT)


def _join(spec: GroupSpec, rank: int, store: dist.Store) -> DataParallel:
    if spec.device == "cuda":
        import torch

        torch.cuda.set_device(spec.rank_device(rank))
    sharding.join_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout_s=spec.timeout_s)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=spec.timeout_s))
    return DataParallel(rank, spec.world_size, control)


def run_rank(rank: int, rendezvous: str, token: BearerToken, join_timeout_s: float,
             allowed_plugins: tuple[str, ...] = ()) -> None:
    """Rank `rank` (>= 1) of the group whose rank 0 serves its rendezvous at `rendezvous`, reached with
    `token`: join, then run what rank 0 broadcasts until it says stop. Exits the process
    (WORKER_LOST_EXIT) when rank 0 is lost. A rendezvous that refuses `token` raises RendezvousRefused.

    Only token holders write the spec, and still a rank imports only what it was started allowing: the
    modules the spec names must be among `allowed_plugins`; any other is refused before anything is
    imported."""
    ranks, spec_dict = join_store(rendezvous, rank, token, join_timeout_s)
    try:
        _run_joined(rank, rendezvous, token, ranks.store, GroupSpec.from_dict(spec_dict), allowed_plugins)
    finally:
        ranks.close()


def _run_joined(rank: int, rendezvous: str, token: BearerToken, store: dist.Store, spec: GroupSpec,
                allowed_plugins: tuple[str, ...]) -> None:
    """run_rank once joined: check the spec, form the group, run rank 0's commands until it says stop."""
    from services.common.process.structured_logging import configure_logging

    from services.trainer.plugins import import_attention_plugins

    if not 1 <= rank < spec.world_size:
        raise ValueError(f"rank: {rank} is not a worker rank of a group of {spec.world_size}")
    foreign = sorted(set(spec.attention_plugins) - set(allowed_plugins))
    if foreign:
        raise ValueError(f"attention_plugins: rank 0's group imports {foreign}, which this rank was not started "
                         f"with (--attention-plugins {','.join(allowed_plugins) or '(none)'})")
    configure_logging(f"trainer-rank{rank}", spec.log_level)
    import_attention_plugins(list(spec.attention_plugins))
    link = LivenessLink(store.get(LIVENESS_KEY).decode(), rank, token, _lost_exit, spec.timeout_s)
    dp = _join(spec, rank, store)
    log.info("trainer rank joined", extra={"fields": {"rank": rank, "world_size": spec.world_size,
                                                       "rendezvous": rendezvous, "backend": spec.backend}})
    trainer = Trainer(device=spec.rank_device(rank), num_threads=spec.num_threads, dp=dp)
    while True:
        try:
            command = dp.broadcast_command(None)
        except Exception as exc:  # noqa: BLE001 - rank 0 gone mid-collective: the group is over
            _lost_exit(f"rank 0 ({type(exc).__name__}: {exc})")
        if command is None:
            break
        name, kwargs = command
        try:
            result = getattr(trainer, name)(**kwargs)
            status = (True, result if isinstance(result, str) else "")
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which decides
            status = (False, f"{type(exc).__name__}: {exc}")
        try:
            dp.gather_status(status)
        except Exception as exc:  # noqa: BLE001
            _lost_exit(f"a peer ({type(exc).__name__}: {exc})")
    link.close()
    dist.destroy_process_group()


class GroupTrainer:
    """Rank 0's face of the group: the Trainer interface the gRPC servicer uses."""

    def __init__(self, spec: GroupSpec, token: BearerToken | None = None) -> None:
        """`token`: what rank 0's rendezvous admits (the deployment's). Ranks started elsewhere need it;
        without one, the ranks this process starts get a fresh token of the group's own."""
        if spec.world_size < 2:
            raise ValueError(f"world_size: a group needs 2 or more ranks, got {spec.world_size}")
        if token is None and spec.ranks_elsewhere:
            raise ValueError("token: ranks started elsewhere join with the deployment's token; none was given")
        token = token or BearerToken(generate_token())
        self.spec = spec
        self.broken = ""
        self._closing = False
        rendezvous = spec.rendezvous or f"127.0.0.1:{free_port()}"
        self.ranks = serve_store(rendezvous, spec.world_size, spec.as_dict(), token, spec.timeout_s)
        self.store = self.ranks.store
        self.liveness = LivenessHub(split_address(rendezvous)[0], spec.world_size, _lost_exit, token)
        self.store.set(LIVENESS_KEY, self.liveness.published())
        self.workers = []
        if not spec.ranks_elsewhere:
            ctx = multiprocessing.get_context("spawn")  # fork would copy gRPC and torch threads mid-flight
            self.workers = [ctx.Process(target=run_rank,
                                        args=(r, rendezvous, token, spec.timeout_s, spec.attention_plugins),
                                        name=f"trainer-rank{r}", daemon=True) for r in range(1, spec.world_size)]
            for w in self.workers:
                w.start()
            # Watch from the start: a rank that dies before the rendezvous (an import error on that
            # rank, say) would otherwise leave rank 0 waiting out the whole collective timeout.
            threading.Thread(target=self._watch_workers, name="trainer-group-watch", daemon=True).start()
        else:
            log.info("waiting for trainer ranks", extra={"fields": {
                "world_size": spec.world_size, "rendezvous": rendezvous}})
        self.dp = _join(spec, 0, self.store)
        self.liveness.accept_all(spec.timeout_s)
        self.trainer = Trainer(device=spec.rank_device(0), num_threads=spec.num_threads, dp=self.dp)
        log.info("data-parallel trainer group up", extra={"fields": {
            "world_size": spec.world_size, "backend": spec.backend, "device": spec.device,
            "rendezvous": rendezvous}})

    def _watch_workers(self) -> None:
        from multiprocessing.connection import wait

        wait([w.sentinel for w in self.workers])
        if self._closing:
            return
        dead = [f"rank {i + 1} (exit {w.exitcode})" for i, w in enumerate(self.workers) if not w.is_alive()]
        _lost_exit(", ".join(dead) or "a rank process")

    def _replicated(self, name: str, **kwargs):
        return self._on_all_ranks(name, **kwargs)[0]

    def _on_all_ranks(self, name: str, *, rank0_alone_writes: bool = False,
                      **kwargs) -> tuple[object, list[tuple[bool, str]]]:
        """Run Trainer.<name> on every rank: rank 0's result and every rank's (ok, message).

        `rank0_alone_writes`: after its collectives the call writes files on rank 0 alone, so rank 0
        failing there (a full disk) while the others succeed leaves the ranks in step: the error is
        raised, the group is not broken."""
        if self.broken:
            raise RuntimeError(f"trainer group is broken ({self.broken}); restart the trainer service")
        try:
            self.dp.broadcast_command((name, kwargs))
        except Exception as exc:  # noqa: BLE001 - a rank gone: the group cannot go on
            _lost_exit(f"a rank ({type(exc).__name__}: {exc})")
        error: BaseException | None = None
        try:
            result = getattr(self.trainer, name)(**kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks have compared notes
            error, result = exc, None
        try:
            statuses = self.dp.gather_status((error is None, "" if error is None else f"{type(error).__name__}: {error}"))
        except Exception as exc:  # noqa: BLE001 - a rank gone mid-command: the group cannot go on
            _lost_exit(f"a rank ({type(exc).__name__}: {exc})")
        diverged = [f"rank {r}: {msg or 'ok'}" for r, (ok, msg) in enumerate(statuses) if ok != (error is None)]
        if diverged and rank0_alone_writes and error is not None and all(ok for ok, _ in statuses[1:]):
            raise error
        if diverged:
            self.broken = f"{name} failed on some ranks only: " + "; ".join(diverged)
            log.critical("trainer group broken: %s", self.broken)
            raise RuntimeError(self.broken) from error
        if error is not None:
            raise error
        return result, statuses

    def configure(self, **kwargs):
        return self._replicated("configure", **kwargs)

    def train_step(self, request):
        return self._replicated("train_step", request=request)

    def check_parity(self, request):
        return self._replicated("check_parity", request=request)

    def weight_tensors(self, run_id: str, *, cast: bool = True):
        return self._replicated("weight_tensors", run_id=run_id, cast=cast)

    def save_checkpoint(self, run_id: str, directory: str):
        return self._on_all_ranks("save_checkpoint", rank0_alone_writes=True, run_id=run_id,
                                  directory=directory)[0]

    def load_checkpoint(self, run_id: str, directory: str):
        return self._replicated("load_checkpoint", run_id=run_id, directory=directory)

    def weights_digest(self) -> str:
        return self._replicated("weights_digest")

    def master_state_dict(self):
        return self._replicated("master_state_dict")

    def __getattr__(self, name: str):
        # What reads no weights (info, run state, the snapshot check) on rank 0 alone.
        if name in REPLICATED:
            raise AttributeError(name)
        return getattr(self.trainer, name)

    def close(self) -> None:
        self._closing = True
        self.liveness.closing.set()
        if not self.broken:
            self.dp.broadcast_command(None)
        for w in self.workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
        self.liveness.close()
        dist.destroy_process_group()
        self.ranks.close()
