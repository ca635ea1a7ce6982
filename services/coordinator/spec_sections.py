"""The checks of the run spec's sections for distillation and supervised runs (`teacher`, `kind`, `sft`,
`start_from`), kept out of run_spec.py, whose validators call them and name the field each refusal gives."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.common.models.directory import check_model_dir
from services.coordinator.vocabulary import vocabulary_difference


class StartFromSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
