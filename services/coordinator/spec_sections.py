"""Sections of the run spec (run_spec.RunSpec holds them): evaluation, checkpoints, debug, async, where a run
starts from; the checks of the distillation and supervised sections (`teacher`, `kind`, `sft`), which RunSpec's
validators call, naming the field each refusal gives; and the error helpers every validator uses."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from services.common.float32_fields import Float32

from services.common.models.directory import check_model_dir
from services.coordinator.vocabulary import vocabulary_difference


MAX_PATH_LENGTH = 4096
"""Longest path a spec may name (Linux's PATH_MAX)."""


class StrictModel(BaseModel):
    """A spec section: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


MAX_EVAL_K = 64
"""Most samples per problem an evaluation may draw."""
MAX_EVAL_SETS = 16
"""Most extra eval sets a run may name."""
MAX_EVAL_PROBLEMS = 100_000
"""Most problems one evaluation covers, over the held-out split and every extra set."""
MAX_EVAL_SAMPLES = 1_000_000
"""Most samples one evaluation draws (problems times k)."""
HELDOUT_SET = "heldout"
"""The eval set that is the task's own held-out split (its first heldout_size problems)."""
EVAL_SET_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
"""What a set name must match: it becomes part of metric keys and a Prometheus label value."""


class EvalSetSpec(StrictModel):
    name: str = Field(..., pattern=EVAL_SET_NAME_PATTERN, description="Set name, as it appears in the metrics "
                      "(eval/<name>/avg@k) and the `set` label; unique within the run; 'heldout' is the task's "
                      "own held-out split and cannot be used here.")
    path: str = Field(..., min_length=1, max_length=MAX_PATH_LENGTH, description="Local JSONL file, read at "
                      "submit time with the run's task's reader (math: the format of task.options.path; "
                      "arithmetic: one {\"a\": int, \"b\": int} per line) and scored with the task's reward. "
                      "Must lie inside the coordinator's data roots.")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v == HELDOUT_SET:
            raise ValueError(f"{HELDOUT_SET!r} is the task's own held-out split; name this set otherwise")
        return v


class EvalSpec(StrictModel):
    every: int = Field(5, ge=0, description="Evaluate every N steps (always before step 1 and after the last); 0 = only those two.")
    heldout_size: int = Field(200, ge=1, le=MAX_EVAL_PROBLEMS, description="Problems of the task's held-out split "
                              "evaluated each time (set 'heldout').")
    k: int = Field(1, ge=1, le=MAX_EVAL_K, description="Samples per problem: avg@k is the mean reward over them, "
                   "pass@k the fraction of problems with at least one correct sample.")
    temperature: Float32 = Field(0.0, ge=0, le=10, description="Sampling temperature of eval samples (top_p 1, "
                                 "top_k off); 0 = greedy. Greedy with k = 1 is the plain held-out accuracy.")
    max_new_tokens: int | None = Field(None, ge=1, le=32768, description="Eval response length cap in tokens; "
                                       "null = rollout.sampling.max_new_tokens.")
    sets: list[EvalSetSpec] = Field(default_factory=list, max_length=MAX_EVAL_SETS, description="Extra held-out "
                                    "sets evaluated beside the task's own ('heldout'), each in full.")

    @model_validator(mode="after")
    def _consistent(self) -> "EvalSpec":
        if 0 < self.temperature < 0.01:
            raise field_error("eval.temperature", f"{self.temperature} is neither 0 (greedy) nor at least 0.01")
        if self.k > 1 and self.temperature == 0:
            raise field_error("eval.k", f"{self.k} greedy samples of one problem are all the same; "
                              "set eval.temperature > 0 or k = 1")
        seen: set[str] = set()
        for i, eval_set in enumerate(self.sets):
            if eval_set.name in seen:
                raise field_error(f"eval.sets.{i}.name", f"{eval_set.name!r} names an earlier set too")
            seen.add(eval_set.name)
        return self


def field_error(field: str, reason: str) -> PydanticCustomError:
    """An error of `field` (dotted, from the spec's root) raised by a validator above it: validation_fields
    reports it under that field rather than the validator's own location."""
    return PydanticCustomError("refused_field", "{field}: {reason}", {"field": field, "reason": reason})


def fields_error(fields: list[tuple[str, str]]) -> PydanticCustomError:
    """field_error for several fields at once: validation_fields reports each under its own name."""
    message = "; ".join(f"{field}: {reason}" for field, reason in fields)
    return PydanticCustomError("refused_fields", "{message}", {"message": message, "fields": fields})


class CheckpointSpec(StrictModel):
    every: int = Field(0, ge=0, description="Save a checkpoint every N steps (and after the last step, unless "
                       "`final` is false); 0 = only after the last step.")
    final: bool = Field(True, description="Save a checkpoint after the last step. False for a run whose weights "
                        "are not kept (a benchmark, a smoke test): on a large policy the last checkpoint (weights "
                        "and optimizer state) can take longer to write than the run took to train.")


class DebugSpec(StrictModel):
    record_trajectories: bool = Field(
        False,
        description="Write each step's TrainStep input (header + trajectories, as sent) to "
        "<run dir>/trajectories/step_NNNNNN.pb, before the trainer applies it; "
        "`python -m services.trainer.tools.replay` replays one into a fresh trainer.",
    )


class AsyncSpec(StrictModel):
    max_staleness: int = Field(
        0, ge=0, le=64, description="K: how many policy versions a step's rollout may lag the policy it trains. "
        "0 is the synchronous loop (step s samples with version s-1). With K > 0 the trainer's loss must correct "
        "for off-policy data (trainer.mismatch_correction.mode 'truncate' or 'mask', or trainer.policy_loss.kind "
        "'m2po').")
    mode: Literal["fixed_lag", "streaming"] = Field(
        "fixed_lag", description="'fixed_lag': the rollout of step s uses exactly policy version max(0, s-1-K), "
        "so which version produced each trajectory is arithmetic, not timing; the rollouts of later steps run "
        "while a step trains. 'streaming': the replicas generate continuously, a weight update pauses the "
        "sequences in flight at a token boundary and continues them under the new weights, and a trajectory "
        "trains step s only if every token's version is >= s-1-K (others are dropped and counted). Streaming "
        "runs with either engine and refuses dynamic sampling; it is not bitwise reproducible (which "
        "version makes a token depends on timing).")


class StartFromSpec(StrictModel):
    run: str = Field(..., min_length=1, max_length=64, description="Id of the run whose checkpoint this run starts "
                     "from (SFT, then RL, then distillation).")
    step: int | None = Field(None, ge=1, le=1_000_000, description="Its checkpoint of this step; null = its last.")


def teacher_refusal(teacher_path: str, student_path: str | None) -> str | None:
    """Why teacher.model_path is refused (not a model directory, another vocabulary), or None."""
    try:
        check_model_dir(teacher_path)
        if student_path is None:  # a bad model_path is reported on its own field
            return None
        return vocabulary_difference(student_path, teacher_path)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc).removeprefix("model_path: ")
    except OSError as exc:
        return f"cannot read {teacher_path!r}: {exc.strerror}"


def kind_refusal(spec) -> tuple[str, str] | None:
    """(field, reason) of the first setting a RunSpec's `kind` contradicts, or None."""
    objective = "sft" if spec.kind == "sft" else "policy_gradient"
    if "objective" in spec.trainer.model_fields_set and spec.trainer.objective != objective:
        return "trainer.objective", f"{spec.trainer.objective!r} contradicts kind {spec.kind!r}; set `kind` alone"
    if spec.kind == "rl":
        return ("sft", "a dataset for kind 'sft'; this run is kind 'rl'") if spec.sft is not None else None
    if spec.sft is None:
        return "sft", "required by kind 'sft': the dataset to train on"
    for field, refused, why in (
            ("teacher", spec.teacher is not None, "a supervised run samples nothing for a teacher to score"),
            ("async.max_staleness", spec.async_.max_staleness > 0, "a supervised run has no rollouts to lag"),
            ("rollout.dynamic_sampling.enabled", spec.rollout.dynamic_sampling.enabled,
             "a supervised run samples no groups"),
            ("trainer.kl_coef", spec.trainer.kl_coef > 0, "the KL penalty is a policy-gradient term")):
        if refused:
            return field, f"refused with kind 'sft': {why}"
    return None
