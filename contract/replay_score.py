"""The trainer's replay-score as a process: its configuration, its command line, its result.

`lockstep replay-score` (services/cli) imports no trainer code and no torch:
it validates a ReplayScoreConfig, runs `python -m REPLAY_SCORE_MODULE` with
the config as its flags, and reads the report the entry point prints on
stdout as one JSON object (non-finite floats as strings). The entry point
exits REFUSED_EXIT after writing `replay-score: <reason>` on stderr when it
refuses the bundle, the record or the checkpoint. Pydantic only, no torch.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

REPLAY_SCORE_MODULE = "services.trainer.tools.replay_score"
"""The trainer's entry point, run with `python -m`."""
REFUSED_EXIT = 2
"""Its exit status for a refused bundle, record, checkpoint or configuration."""


class ReplayScoreConfig(BaseModel):
    """Re-score one recorded step of a run bundle (services/common/records/run_bundle.py) on this machine."""

    model_config = ConfigDict(extra="forbid")

    bundle: str = Field(..., description="The bundle directory (lockstep export).")
    step: int = Field(..., ge=1, description="The recorded step to score.")
    checkpoint: str = Field(
        "", description="Checkpoint at the step's starting policy version (step - 1) on this machine; empty for "
        "step 1, which starts from the run's model.")
    model: str = Field(
        "", description="The run's model directory on this machine; empty: the path the record names (the "
        "exporting machine's).")
    device: str = Field("cpu", description="torch device, as the trainer service's --device.")
    num_threads: int = Field(
        1, ge=0, description="torch CPU threads: equal to the recording trainer's for bitwise-equal results.")
    worst_tokens: int = Field(8, ge=0, le=1000, description="How many tokens with the largest |logp - rollout_logp| "
                              "the report lists.")


def replay_score_command(python: str, config: ReplayScoreConfig) -> list[str]:
    """The entry point's command line: every field as `--field-name=value`, the flags the entry point's
    parser (services.common.process.service_config.parse_service_config) reads. Each value is one element
    joined to its flag, so a path that starts with '-' stays a value."""
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in config.model_dump().items()]
    return [python, "-m", REPLAY_SCORE_MODULE, *flags]
