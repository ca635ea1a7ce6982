"""On-policy distillation's per-token advantage and its step metrics: pure functions over flat tensors.

The student sampled every response token; the teacher scored the same tokens (services/trainer/teacher.py).
Token t of a sequence gets the reward r_t = teacher_logp_t - student_logp_t, a one-sample estimate of
-KL(student || teacher) at that position (the reverse KL: the student's own samples, so mode-seeking),
and the advantage

    A_t = kl_weight * sum_{k >= t} gamma^(k - t) r_k  +  reward_weight * A_task(sequence)

which the run's policy objective (PPO-clip by default) then uses exactly as it uses a GRPO advantage.
gamma = 0 is the usual on-policy distillation (each token its own log-ratio). The student's log-prob is
the rollout's: the behaviour policy's, exact in numerics 'true_on_policy', so no extra student pass.

Numerics: every advantage is computed in float64 from the float32 inputs and rounded to float32 once
(tests/trainer/loss/test_loss_oracle.py holds it to a float64 oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from contract.trainer_settings import TeacherSettings


def reverse_kl_returns(teacher_logp: torch.Tensor, student_logp: torch.Tensor, sample_index: torch.Tensor,
                       ranks: torch.Tensor, *, discount: float) -> torch.Tensor:
    """float64 [N]: each token's discounted sum of (teacher - student) log-ratios over its sequence's later tokens.

    Tokens may come in any order: `sample_index` names each token's sequence and `ranks` its index among
    that sequence's loss tokens (Microbatch.response_ranks); every token of a sequence must be present."""
    if not (teacher_logp.shape == student_logp.shape == sample_index.shape == ranks.shape) or teacher_logp.dim() != 1:
        raise ValueError("reverse_kl_returns: want four 1-d tensors of one shape, got "
                         f"{[tuple(t.shape) for t in (teacher_logp, student_logp, sample_index, ranks)]}")
    r = teacher_logp.detach().double() - student_logp.detach().double()
    if discount == 0 or r.numel() == 0:
        return r
    # Sort by (sequence, rank), run the backward recursion A_t = r_t + gamma A_{t+1} per sequence, scatter back.
    key = sample_index.to(torch.int64) * (int(ranks.max()) + 1) + ranks.to(torch.int64)
    order = torch.argsort(key.cpu(), stable=True)
    r_sorted = r.cpu()[order].tolist()
    seq_sorted = sample_index.cpu()[order].tolist()
    out = [0.0] * len(r_sorted)
    running, current = 0.0, None
    for i in range(len(r_sorted) - 1, -1, -1):
        if seq_sorted[i] != current:
            running, current = 0.0, seq_sorted[i]
        running = r_sorted[i] + discount * running
        out[i] = running
    returns = torch.empty_like(r, device="cpu")
    returns[order] = torch.tensor(out, dtype=torch.float64)
    return returns.to(r.device)


def distillation_advantages(settings: TeacherSettings, teacher_logp: torch.Tensor, student_logp: torch.Tensor,
                            task_advantages: torch.Tensor, sample_index: torch.Tensor,
                            ranks: torch.Tensor) -> torch.Tensor:
    """float32 [N]: kl_weight * reverse_kl_returns + reward_weight * task advantage, rounded to float32 once."""
    returns = reverse_kl_returns(teacher_logp, student_logp, sample_index, ranks, discount=settings.discount)
    mixed = settings.kl_weight * returns
    if settings.reward_weight:
        mixed = mixed + settings.reward_weight * task_advantages.detach().double()
    return mixed.to(torch.float32)


@dataclass(frozen=True)
class DistillationStats:
    reverse_kl: float        # mean over response tokens of student logp - teacher logp
    argmax_agreement: float  # fraction of response positions where teacher and student argmax agree


def distillation_stats(teacher_logp: torch.Tensor, student_logp: torch.Tensor, teacher_argmax: torch.Tensor,
                       student_argmax: torch.Tensor) -> DistillationStats:
    """The step's distillation health from every response token (float64 means)."""
    if teacher_logp.numel() == 0:
        raise ValueError("distillation_stats: no response tokens")
    d = student_logp.detach().double() - teacher_logp.detach().double()
    return DistillationStats(reverse_kl=d.sum().item() / d.numel(),
                             argmax_agreement=(teacher_argmax == student_argmax).double().mean().item())
