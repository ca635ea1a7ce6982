"""A multi-rank (FSDP) trainer on one host: the serving process is rank 0, it starts ranks 1..N-1.

Rank 0 answers every RPC. Every rank holds 1/N of each master weight, so
whatever touches the weights (ConfigureRun, TrainStep, CheckParity,
GetWeights, SaveCheckpoint, LoadCheckpoint, digests) is broadcast to every
rank first and executed by all of them in the same order (each is a sequence
of collectives); each rank then reports (ok, error) and rank 0 compares: a
rank that failed where rank 0 did not leaves the shards out of step, so the
group is marked broken and refuses everything after (fail closed). Info
runs on rank 0 alone.

A worker process that dies takes the service down (exit code 70): a group
missing a rank cannot step, and the supervisor restarting the trainer plus
the coordinator resuming it from the run's last checkpoint is the recovery.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass

import torch.distributed as dist

from services.common.ports import free_port
from services.trainer import sharding
from services.trainer.data_parallel import DataParallel
from services.trainer.trainer import Trainer

log = logging.getLogger("lockstep.trainer.group")
WORKER_LOST_EXIT = 70
# What rank 0 broadcasts: the Trainer methods every rank must run (collectives over the shards).
REPLICATED = ("configure", "train_step", "check_parity", "weight_tensors", "save_checkpoint", "load_checkpoint",
              "weights_digest", "master_state_dict")


@dataclass(frozen=True)
class GroupSpec:
    world_size: int
    device: str          # 'cpu' or 'cuda' (rank r uses cuda:r)
    num_threads: int
    timeout_s: float     # collective timeout: a rank stuck longer fails the step
    log_level: str = "info"
    attention_plugins: tuple[str, ...] = ()  # imported by every rank, as the service imports them

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else "cpu"


def _join(spec: GroupSpec, rank: int, init_method: str) -> DataParallel:
    if spec.device == "cuda":
        import torch

        torch.cuda.set_device(rank)
    sharding.join_group(spec.backend, init_method=init_method, rank=rank, world_size=spec.world_size,
                        timeout_s=spec.timeout_s)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=spec.timeout_s))
    return DataParallel(rank, spec.world_size, control)


def _worker_main(spec: GroupSpec, rank: int, init_method: str) -> None:
    from services.common.structured_logging import configure_logging

    from services.trainer.plugins import import_attention_plugins

    configure_logging(f"trainer-rank{rank}", spec.log_level)
    import_attention_plugins(list(spec.attention_plugins))
    dp = _join(spec, rank, init_method)
    trainer = Trainer(device=spec.rank_device(rank), num_threads=spec.num_threads, dp=dp)
    while True:
        command = dp.broadcast_command(None)
        if command is None:
            break
        name, kwargs = command
        try:
            result = getattr(trainer, name)(**kwargs)
            status = (True, result if isinstance(result, str) else "")
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which decides
            status = (False, f"{type(exc).__name__}: {exc}")
        dp.gather_status(status)
    dist.destroy_process_group()


class GroupTrainer:
    """Rank 0's face of the group: the Trainer interface the gRPC servicer uses."""

    def __init__(self, spec: GroupSpec) -> None:
        if spec.world_size < 2:
            raise ValueError(f"world_size: a group needs 2 or more ranks, got {spec.world_size}")
        self.spec = spec
        self.broken = ""
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")  # fork would copy gRPC and torch threads mid-flight
        self.workers = [ctx.Process(target=_worker_main, args=(spec, r, init_method), name=f"trainer-rank{r}",
                                    daemon=True) for r in range(1, spec.world_size)]
        self._closing = False
        for w in self.workers:
            w.start()
        # Watch from the start: a rank that dies before the rendezvous (an import error on that
        # rank, say) would otherwise leave rank 0 waiting out the whole collective timeout.
        threading.Thread(target=self._watch_workers, name="trainer-group-watch", daemon=True).start()
        self.dp = _join(spec, 0, init_method)
        self.trainer = Trainer(device=spec.rank_device(0), num_threads=spec.num_threads, dp=self.dp)
        log.info("data-parallel trainer group up", extra={"fields": {
            "world_size": spec.world_size, "backend": spec.backend, "device": spec.device}})

    def _watch_workers(self) -> None:
        from multiprocessing.connection import wait

        wait([w.sentinel for w in self.workers])
        if self._closing:
            return
        dead = [f"rank {i + 1} (exit {w.exitcode})" for i, w in enumerate(self.workers) if not w.is_alive()]
        log.critical("trainer worker lost: %s; exiting so the service is restarted and resumed", ", ".join(dead))
        os._exit(WORKER_LOST_EXIT)

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
        self.dp.broadcast_command((name, kwargs))
        error: BaseException | None = None
        try:
            result = getattr(self.trainer, name)(**kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised after the ranks have compared notes
            error, result = exc, None
        statuses = self.dp.gather_status((error is None, "" if error is None else f"{type(error).__name__}: {error}"))
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

    def weight_tensors(self, run_id: str):
        return self._replicated("weight_tensors", run_id=run_id)

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
        if not self.broken:
            self.dp.broadcast_command(None)
        for w in self.workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
        dist.destroy_process_group()
