"""The run as the trainer holds it: configuring it (from the run's last checkpoint when it lost the
run), training and replaying steps, checkpoints, and waiting for a lost trainer to come back
(TrainerRecovery: the run loop configures the services again once it answers).

A checkpoint the trainer refuses for lack of disk space wrote nothing, and the trainer still holds the
step it trained: the checkpoint is tried again (SpaceRetry) and, when space does not return within the
window, the run is paused (RunPaused) before the step is recorded. Resumed, the trainer replays that
step (or, if it lost the run meanwhile, recomputes it from the last checkpoint), so the step is trained
once and recorded once.

The trainer keeps its state across a coordinator restart and treats a TrainStep for a step it
already applied as a replay (it returns that step's recorded metrics and does not train again).
The trajectory counts of a step are stored before the trainer applies it, so a replay accounts for
every trajectory exactly once."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from proto import lockstep_pb2 as pb
from services.coordinator.clients import CheckpointOutOfSpace, TrainerClient, TrainerUnavailable
from services.coordinator.run.errors import RunFailed, RunPaused
from services.coordinator.run_spec import RunSpec
from services.coordinator.state.event_log import EventLog
from services.coordinator.state.store import RunStore


# A wait is cut into slices this long, so a cancel is noticed within one.
CANCEL_CHECK_S = 1.0


@dataclass(frozen=True)
class SpaceRetry:
    """How a checkpoint refused for lack of disk space is tried again (CoordinatorConfig's
    checkpoint_retry_* fields): waits from `interval_s`, doubling up to `interval_max_s`, while the
    time since the first refusal stays within `window_s`."""

    window_s: float = 600.0
    interval_s: float = 5.0
    interval_max_s: float = 60.0

    def next_wait(self, refusals: int, waited_s: float) -> float | None:
        """The wait after the `refusals`-th refusal, `waited_s` seconds after the first; None when
        that wait would end past the window (the run is paused instead)."""
        wait = min(self.interval_s * 2.0 ** min(refusals - 1, 30), self.interval_max_s)
        return wait if waited_s + wait <= self.window_s else None


class TrainerSession:
    def __init__(self, run_id: str, spec: RunSpec, trainer: TrainerClient, store: RunStore, events: EventLog,
                 run_dir: Path, *, recovery_timeout_s: float, check_cancelled: Callable[[], Awaitable[None]],
                 space_retry: SpaceRetry = SpaceRetry()) -> None:
        self.run_id, self.spec, self.trainer, self.store, self.events = run_id, spec, trainer, store, events
        self.run_dir = run_dir
        self.recovery_timeout_s = recovery_timeout_s
        self.check_cancelled = check_cancelled
        self.space_retry = space_retry
        self.details: dict[str, str] = {}
        """What the trainer reported of itself (ServiceInfo details) when the run was last configured."""

    @property
    def weights_address(self) -> str:
        return self.trainer.weights_address

    async def configure(self) -> int:
        """Configure the run on the trainer; the policy version it holds. A trainer that still holds
        the run keeps its state; one that does not (restarted) resumes from the last checkpoint, or
        starts from the model."""
        checkpoint = await self.store.get_aux(self.run_id, "last_checkpoint")
        info = await self.trainer.configure(
            self.run_id, self.spec.model_path, self.spec.seed, self.spec.trainer.model_dump_json(),
            resume_checkpoint=checkpoint["path"] if checkpoint else "",
        )
        self.details = dict(info.details)
        return info.policy_version

    async def lost(self, step: int, lost: TrainerUnavailable) -> TrainerRecovery:
        """The trainer stopped answering at `step`: the event, and the wait for it to come back (RunFailed
        when trainer_recovery_timeout_s is 0)."""
        timeout = self.recovery_timeout_s
        await self.events.record("trainer_lost", "trainer lost", step=step, reason=str(lost),
                                 recovery_timeout_s=timeout)
        if timeout <= 0:
            raise RunFailed(f"step {step}: {lost} (trainer_recovery_timeout_s is 0)")
        return TrainerRecovery(self, step, timeout)

    async def train(self, header: pb.TrainStepHeader, trajectories: list[pb.Trajectory],
                    counts: dict[str, int]) -> pb.StepMetrics:
        """Apply one step. Its trajectory counts are stored first, so that a replay after a coordinator
        crash still accounts for every trajectory exactly once."""
        await self.store.set_aux(self.run_id, "pending_step", {"step": header.step, "counts": counts})
        return await self.trainer.train_step(header, trajectories)

    async def replay(self, header: pb.TrainStepHeader) -> tuple[pb.StepMetrics, dict[str, int]]:
        """A step the trainer applied before the previous coordinator died: its recorded metrics and
        trajectory counts, without training twice."""
        step = header.step
        result = await self.trainer.train_step(header, [])
        if not result.replayed:
            raise RunFailed(f"step {step}: trainer at version {step} did not replay the step")
        pending = await self.store.get_aux(self.run_id, "pending_step")
        if pending is None or pending["step"] != step:
            raise RunFailed(f"step {step}: replayed by the trainer but its trajectory counts were not recorded")
        await self.events.record("step_replayed", "step replayed", step=step)
        return result, pending["counts"]

    async def checkpoint(self, step: int) -> None:
        """Have the trainer write the step's checkpoint; while it refuses for lack of disk space, retry
        (each refusal an event) and, past the retry window, pause the run (RunPaused)."""
        path = str(self.run_dir / "checkpoints" / f"step_{step:06d}")
        retry, refusals, first = self.space_retry, 0, time.monotonic()
        while True:
            try:
                await self.trainer.save_checkpoint(self.run_id, path)
                break
            except CheckpointOutOfSpace as exc:
                refusals += 1
                wait = retry.next_wait(refusals, time.monotonic() - first)
                await self.events.record("checkpoint_out_of_space", "checkpoint refused for lack of disk space",
                                         step=step, path=path, refusals=refusals, reason=str(exc),
                                         then="retry" if wait is not None else "pause", retry_in_s=wait,
                                         retry_window_s=retry.window_s)
                if wait is None:
                    raise RunPaused(
                        f"step {step}: no disk space for checkpoint {path} ({refusals} attempt(s) within "
                        f"checkpoint_retry_window_s = {retry.window_s:g} s): {exc}. Free space there, then "
                        f"POST /v1/runs/{self.run_id}/resume") from None
                await self._wait(wait)
        if refusals:
            await self.events.record("checkpoint_space_recovered", "checkpoint written once disk space returned",
                                     step=step, path=path, attempts=refusals + 1)
        # What a restarted trainer resumes from (the coordinator need not see the trainer's disk).
        await self.store.set_aux(self.run_id, "last_checkpoint", {"step": step, "path": path})

    async def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, CANCEL_CHECK_S))
            await self.check_cancelled()


# The longest wait between two health checks of a lost trainer. A check is one Health RPC; at 5 s a trainer back
# in service sat idle for up to 10-15 s more (this wait and the channel's own reconnect backoff, clients.py, out
# of phase), longer than a restarted trainer takes to start.
RECOVERY_POLL_MAX_S = 1.0


class TrainerRecovery:
    """One wait for a lost trainer, within trainer_recovery_timeout_s of its loss: the trainer is asked
    for its health until it answers, with waits from 0.5 s doubling up to RECOVERY_POLL_MAX_S. The run loop then
    configures the services itself (the trainer from the run's last checkpoint, the fleet at its
    version), and calls retry() when that finds the trainer gone again."""

    def __init__(self, session: TrainerSession, step: int, timeout_s: float) -> None:
        self.session, self.step, self.timeout_s = session, step, timeout_s
        self.deadline, self.delay = time.monotonic() + timeout_s, 0.5

    async def trainer_back(self) -> None:
        """Return once the trainer answers; RunFailed when it does not within the timeout."""
        while True:
            await self.session.check_cancelled()
            try:
                await self.session.trainer.health()
                return
            except TrainerUnavailable as exc:
                await self.retry(exc)

    async def retry(self, exc: TrainerUnavailable) -> None:
        """The trainer did not answer (`exc`): wait before asking again, or RunFailed past the deadline."""
        if time.monotonic() + self.delay > self.deadline:
            raise RunFailed(f"step {self.step}: trainer did not come back within {self.timeout_s:.0f} s "
                            f"({exc})") from None
        await asyncio.sleep(self.delay)
        self.delay = min(2 * self.delay, RECOVERY_POLL_MAX_S)

    async def recovered(self, version: int) -> None:
        """The services are configured again, the trainer at `version`: the event says where it resumed from."""
        session = self.session
        checkpoint = await session.store.get_aux(session.run_id, "last_checkpoint")
        await session.events.record("trainer_recovered", "trainer recovered",
                                    export=lambda exporter: exporter.trainer_recovered(session.run_id),
                                    step=self.step, policy_version=version,
                                    resumed_from=checkpoint["path"] if checkpoint else "")
