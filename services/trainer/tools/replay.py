"""`python -m services.trainer.tools.replay --record R [--checkpoint C]`: one recorded step into a fresh trainer.

parse -> build -> run -> close: read the step record (services/common/records/step_record.py), configure an
in-process Trainer for its run from the checkpoint holding the step's starting weights (policy
version step - 1; for step 1 the run's model itself), apply the step, print
{"run_id", "step", "policy_version", "metrics"} as one JSON line. The record went through the same
wire checks the gRPC server applies. Reading a record's request (`recorded_request`) and building the
trainer at the step's start (`trainer_at_step_start`) are what services/trainer/tools/replay_score.py
shares with it.
"""
from __future__ import annotations

import asyncio
import json
import sys

from pydantic import BaseModel, ConfigDict, Field

from services.common.process.service_config import parse_service_config
from services.common.records.step_record import StepRecordMeta, read_step_record
from services.trainer import checkpoint as ckpt
from services.trainer.data.wire import FailedPrecondition, StepRequest, read_train_step
from services.trainer.trainer import StepFailed, Trainer


class ReplayConfig(BaseModel):
    """Replay one recorded training step (a run spec's debug.record_trajectories writes them)."""

    model_config = ConfigDict(extra="forbid")

    record: str = Field(..., description="Step record file (<run dir>/trajectories/step_NNNNNN.pb).")
    checkpoint: str = Field(
        "", description="Checkpoint at the step's starting policy version (step - 1); empty for step 1, "
        "which starts from the run's model.")
    device: str = Field("cpu", description="torch device, as the trainer service's --device.")
    num_threads: int = Field(
        1, ge=0, description="torch CPU threads: equal to the trainer's for bitwise-equal results (0 = default).")


def recorded_request(chunks) -> StepRequest:
    """A step record's chunks, read as the trainer reads a TrainStep stream (every wire check included)."""
    async def stream():
        for c in chunks:
            yield c

    return asyncio.run(read_train_step(stream()))


def trainer_at_step_start(meta: StepRecordMeta, *, checkpoint: str, device: str, num_threads: int,
                          model_path: str = "") -> Trainer:
    """A fresh in-process Trainer configured for the recorded step's run, holding the weights the step
    starts from (policy version meta.step - 1): from `checkpoint`, which must hold that version, or, for
    step 1 without one, the run's model. `model_path`: the run's model directory on this machine; empty,
    the one the record names. ValueError for a checkpoint at another version, or none past step 1."""
    if checkpoint:
        version = ckpt.read_state(checkpoint).policy_version
        if version != meta.step - 1:
            raise ValueError(f"checkpoint: holds policy version {version}; step {meta.step} starts from "
                             f"{meta.step - 1}")
    elif meta.step != 1:
        raise ValueError(f"checkpoint: required for step {meta.step} (the weights at policy version {meta.step - 1})")
    trainer = Trainer(device=device, num_threads=num_threads)
    trainer.configure(run_id=meta.run_id, model_path=model_path or meta.model_path, seed=meta.seed,
                      config_json=meta.trainer_config_json, resume_checkpoint=checkpoint)
    return trainer


def replay(config: ReplayConfig) -> dict:
    meta, chunks = read_step_record(config.record)
    request = recorded_request(chunks)
    trainer = trainer_at_step_start(meta, checkpoint=config.checkpoint, device=config.device,
                                    num_threads=config.num_threads)
    outcome = trainer.train_step(request)
    return {"run_id": meta.run_id, "step": outcome.step, "policy_version": outcome.policy_version,
            "metrics": outcome.metrics}


def main(argv: list[str] | None = None) -> int:
    config = parse_service_config(ReplayConfig, env_prefix="LOCKSTEP_REPLAY", argv=argv)
    try:
        result = replay(config)
    except (ValueError, FileNotFoundError) as exc:  # a bad record or checkpoint (InvalidRequest included)
        print(f"replay: {exc}", file=sys.stderr)
        return 2
    except (FailedPrecondition, StepFailed) as exc:  # the step itself was refused: the parity gate, a NaN
        print(f"replay: step refused: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
