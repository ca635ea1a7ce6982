"""The scored rollouts of a fixed-lag run that are generated but not yet safe to forget, on disk.

A rollout of step t is made by policy version max(0, t-1-K), which the trainer stops serving once it
moves on: a rollout lost with the coordinator could not be generated again. So each one is written
under the run's directory (`rollouts/step_NNNNNN.pb`, the step-record format, and its counts beside
it) before any step uses it, read back by a restarted coordinator or after a trainer recovery, and
deleted once its step is trained and checkpointed (or trained, when no checkpoint comes before the
run's end)."""
from __future__ import annotations

import json
import os
from pathlib import Path

from proto import lockstep_pb2 as pb
from services.common.records.step_record import StepRecordMeta, read_step_record, write_step_record


class KeptRollouts:
    def __init__(self, run_id: str, root: Path, *, model_path: str, seed: int) -> None:
        self.run_id, self.root, self.model_path, self.seed = run_id, root, model_path, seed
        self._cache: dict[int, tuple[list[pb.Trajectory], dict]] = {}

    def _paths(self, step: int) -> tuple[Path, Path]:
        return self.root / f"step_{step:06d}.pb", self.root / f"step_{step:06d}.counts.json"

    def put(self, step: int, version: int, trajectories: list[pb.Trajectory], counts: dict) -> None:
        """Blocking (file I/O): call it off the event loop. The record is written last, so a step whose
        record exists has its counts too."""
        record, counts_path = self._paths(step)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = counts_path.with_name(counts_path.name + ".tmp")
        tmp.write_text(json.dumps(counts, sort_keys=True))
        os.replace(tmp, counts_path)
        header = pb.TrainStepHeader(run_id=self.run_id, step=step, policy_version=version,
                                    num_trajectories=len(trajectories))
        meta = StepRecordMeta(run_id=self.run_id, step=step, policy_version=version, model_path=self.model_path,
                              seed=self.seed, trainer_config_json="")
        write_step_record(record, meta, [pb.TrainStepChunk(header=header),
                                         *(pb.TrainStepChunk(trajectory=t) for t in trajectories)])
        self._cache[step] = (trajectories, counts)

    def get(self, step: int) -> tuple[list[pb.Trajectory], dict] | None:
        """Blocking when it reads the disk. None if the step's rollout was never kept (or is gone)."""
        if step in self._cache:
            return self._cache[step]
        record, counts_path = self._paths(step)
        if not record.is_file():
            return None
        meta, chunks = read_step_record(record)
        if meta.run_id != self.run_id or meta.step != step:
            raise ValueError(f"{record}: holds run {meta.run_id!r} step {meta.step}, not step {step} of this run")
        trajectories = [c.trajectory for c in chunks if c.WhichOneof("item") == "trajectory"]
        self._cache[step] = (trajectories, json.loads(counts_path.read_text()))
        return self._cache[step]

    def has(self, step: int) -> bool:
        return step in self._cache or self._paths(step)[0].is_file()

    def drop(self, step: int) -> None:
        """Forget step `step`'s kept rollout (to generate it again). Blocking (file I/O)."""
        self._cache.pop(step, None)
        for path in self._paths(step):
            path.unlink(missing_ok=True)

    def drop_through(self, step: int) -> None:
        """Forget every kept rollout of steps <= `step`. Blocking (file I/O)."""
        for t in [t for t in self._cache if t <= step]:
            del self._cache[t]
        if not self.root.is_dir():
            return
        for path in self.root.glob("step_*"):
            if int(path.name[len("step_"):len("step_") + 6]) <= step:
                path.unlink(missing_ok=True)
