"""On-policy distillation's teacher as a scoring rank of the trainer: loaded beside the student, it scores
exactly the student's sampled tokens in the student's packed microbatches (docs/distillation.md).

The teacher is a frozen, whole copy on every rank, in the run's compute dtype and numerics, called like the
KL reference: in numerics 'true_on_policy' every op from token ids to a log-prob is batch-invariant, so a
sequence's teacher log-probs are the same bits alone or packed with any others. The per-token advantage it
feeds is services/trainer/loss/distillation.py's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from contract.trainer_run import TrainerRunConfig
from services.trainer.data.batching import Microbatch
from services.trainer.data.wire import InvalidRequest
from services.trainer.loss.distillation import distillation_advantages, distillation_stats
from services.trainer.model.policy import PolicyModule
from services.trainer.run_setup import load_model

FIELD = "trainer_config_json.teacher.model_path"


def load_teacher(config: TrainerRunConfig, device: str, *, student_vocab_size: int) -> PolicyModule:
    """The run's teacher (config.teacher must be set): whole, frozen, in config.dtype, scored with the run's
    numerics. InvalidRequest naming teacher.model_path when its vocabulary is not the student's size."""
    path = str(Path(config.teacher.model_path).resolve())
    teacher = PolicyModule(load_model(path, config, device, dtype=config.dtype, field_name=FIELD),
                           numerics=config.numerics)
    teacher.requires_grad_(False)
    rows = int(teacher.lm.get_input_embeddings().num_embeddings)
    if rows != student_vocab_size:
        raise InvalidRequest(f"{FIELD}: the teacher's vocabulary has {rows} tokens and the student's "
                             f"{student_vocab_size}; distillation needs one tokenizer on both sides")
    return teacher


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's view of one microbatch's response tokens, in its token order (no gradient)."""

    logp: torch.Tensor    # float32 [N]: log-prob of each sampled token, at the run's temperature
    argmax: torch.Tensor  # int64 [N]: the teacher's most likely token at each position
    seconds: float        # wall time of the scoring pass


def score_microbatch(teacher: PolicyModule, microbatch: Microbatch, *, temperature: float) -> TeacherScores:
    """Teacher log-probs and argmax of `microbatch`'s response tokens (one no-grad forward of the teacher)."""
    start = time.perf_counter()
    with torch.no_grad():
        logp, _lse, _ent, argmax = teacher(microbatch, temperature=temperature, with_argmax=True)
    if logp.is_cuda:
        torch.cuda.synchronize(logp.device)  # the time is the pass's, not its launch's
    return TeacherScores(logp.detach(), argmax, time.perf_counter() - start)


def teacher_pass(run, microbatches: list[Microbatch],
                 passes: list[int | None]) -> dict[int, tuple[TeacherScores, torch.Tensor]]:
    """Per microbatch of this rank (`passes`; None marks a collective pass, which the teacher skips: it is whole on
    every rank, so its forward is no collective): the teacher's scores of its response tokens and their
    distillation advantages. The student's log-probs are the rollout's (services/trainer/loss/distillation.py)."""
    cfg = run.config
    out = {}
    for k in passes:
        if k is None:
            continue
        mb = microbatches[k]
        scores = score_microbatch(run.teacher, mb, temperature=cfg.temperature)
        advantages = distillation_advantages(cfg.teacher, scores.logp, mb.response_rollout_logprobs,
                                             mb.response_advantages, mb.response_sample_index, mb.response_ranks)
        out[k] = (scores, advantages.to(scores.logp.device))
    return out


def distillation_metrics(outputs: list, teacher: dict[int, tuple[TeacherScores, torch.Tensor]]) -> dict[str, float]:
    """The step's distillation numbers over this rank's microbatch results (rank 0's, as the step reports them)."""
    def cat(name: str) -> torch.Tensor:
        return torch.cat([getattr(o, name).cpu() for o in outputs])

    stats = distillation_stats(cat("teacher_logp"), cat("rollout_logp"), cat("teacher_argmax"), cat("student_argmax"))
    return {"distill_reverse_kl": stats.reverse_kl, "distill_argmax_agreement": stats.argmax_agreement,
            "teacher_scoring_seconds": sum(scores.seconds for scores, _ in teacher.values())}
