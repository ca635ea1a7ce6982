"""A step's forward and backward passes over this rank's microbatches: each microbatch's forward, its share of
the step loss (policy, supervised or distillation), the router losses of an MoE policy, and its backward, with
the gradients accumulating across microbatches; what each pass hands the step's metrics (MicrobatchResult).

Nothing here reads a value back to the host before the last backward is queued: the loss and the MoE routing
statistics of every microbatch stay on the device until the passes are done, so the device never waits for
the host between one microbatch's forward and its backward, or between two microbatches.
"""
from __future__ import annotations

import dataclasses

import torch

from services.trainer.data.batching import Microbatch
from services.trainer.distributed import sharding
from services.trainer.loss.microbatch_result import MicrobatchResult
from services.trainer.loss.policy_loss import StepShape, microbatch_loss
from services.trainer.loss.supervised import sft_microbatch_loss
from services.trainer.loss.update_guard import nonfinite_tokens
from services.trainer.model.moe import MoeRouting
from services.trainer.run_state import RunState
from services.trainer.teacher import TeacherScores


def forward_backward(run: RunState, microbatches: list[Microbatch], passes: list[int | None], shape: StepShape,
                     device: torch.device | str, keep: torch.Tensor | None,
                     routing: list[torch.Tensor | None] | None = None,
                     teacher: dict[int, tuple[TeacherScores, torch.Tensor]] | None = None,
                     ) -> list[MicrobatchResult]:
    """Forward, loss and backward of this rank's `passes` (indices into `microbatches`; None: a collective pass
    that re-runs microbatch 0 with its loss scaled by zero). Gradients accumulate; the results of this rank's
    microbatches come back in pass order, each taken before the optimizer step."""
    cfg, policy = run.config, run.policy
    moe = MoeRouting.of(policy.lm, cfg.moe)
    local: list[MicrobatchResult] = []
    with sharding.gathered_between_microbatches(policy, len(passes)) as starting:
        for index, k in enumerate(passes):
            starting(index)
            if k is None:
                logp, _lse, _ent = policy(microbatches[0], temperature=cfg.temperature)
                aux = moe.aux_loss(0.0) if moe is not None else None  # a collective pass: same graph, no weight
                (logp.sum() * 0.0 + (aux if aux is not None else 0.0)).backward()
                continue
            mb = microbatches[k]
            rollout_experts = routing[k].to(device) if routing and routing[k] is not None else None
            if moe is not None and cfg.moe.routing_replay:
                moe.force(rollout_experts)  # kept through backward: activation checkpointing routes again
            student_argmax = None
            if teacher is None:
                logp, _lse, ent = policy(mb, temperature=cfg.temperature)
                advantages = mb.response_advantages
            else:
                logp, _lse, ent, student_argmax = policy(mb, temperature=cfg.temperature, with_argmax=True)
                advantages = teacher[k][1]
            moe_stats = aux = None
            if moe is not None:
                moe_stats = moe.microbatch_stats(rollout_experts)
                aux = moe.aux_loss(mb.input_ids.numel() / max(1, sum(m.input_ids.numel() for m in microbatches)))
            ref_logp = None
            if run.ref_model is not None:
                with torch.no_grad():
                    ref_logp = run.ref_model(mb, temperature=cfg.temperature)[0]
            mb_keep = None
            if keep is not None:
                mb_keep = keep[shape.token_keys(mb.response_sample_index, mb.response_ranks)].to(logp.device)
            if cfg.objective == "sft":
                part = sft_microbatch_loss(cfg, logp, mb.response_sample_index, shape)
            else:
                part = microbatch_loss(cfg, logp, mb.response_rollout_logprobs, advantages,
                                       mb.response_sample_index, shape, m2po_keep=mb_keep, ref_logp=ref_logp)
            logp.retain_grad()  # d loss / d logp per token, for naming the tokens of a non-finite update
            (part.loss if aux is None else part.loss + aux).backward()
            if moe is not None:
                moe.force(None)
            # Every forward here runs before the optimizer step, so these are
            # the pre-update log-probs: the train/inference mismatch measure.
            # `loss` is the device tensor until the passes are done (on_host below).
            local.append(MicrobatchResult(
                loss=part.loss.detach(), logp=logp.detach(), rollout_logp=mb.response_rollout_logprobs,
                clipped=part.clipped, clamped=part.clamped, sample_index=mb.response_sample_index,
                positions=mb.response_positions, nonfinite=nonfinite_tokens(part.token_loss, logp, logp.grad),
                is_weight=part.is_weight, is_affected=part.is_affected, entropy=ent.detach(), kl=part.kl,
                moe_stats=moe_stats, teacher_logp=None if teacher is None else teacher[k][0].logp,
                teacher_argmax=None if teacher is None else teacher[k][0].argmax, student_argmax=student_argmax))
    return [on_host(result) for result in local]


def on_host(result: MicrobatchResult) -> MicrobatchResult:
    """`result` with its loss a Python float and its MoE statistics on the CPU (the form MicrobatchResult
    documents), read back once every pass is queued."""
    return dataclasses.replace(
        result, loss=float(result.loss),
        moe_stats=None if result.moe_stats is None else result.moe_stats.cpu())
