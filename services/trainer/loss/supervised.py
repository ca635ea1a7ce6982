"""Supervised fine-tuning's loss (objective 'sft'): the negative log-likelihood of the completion tokens.

The tokens a microbatch scores are its loss tokens (Microbatch.loss_mask: the response, minus a
conversation's non-assistant turns), so the prompt never enters the loss and its tokens change a completion
token's gradient only through the context they give. Aggregated as the policy losses are
(policy_loss.aggregate_loss: token_mean by default, step-wide divisors), so the microbatch split does not
change the update.
"""
from __future__ import annotations

import torch

from contract.trainer_run import TrainerRunConfig
from services.trainer.loss.policy_loss import MicrobatchLoss, StepShape, aggregate_loss


def sft_microbatch_loss(config: TrainerRunConfig, logp: torch.Tensor, sample_index: torch.Tensor,
                        step: StepShape) -> MicrobatchLoss:
    """-logp per token, aggregated by config.loss_agg; the policy terms' masks are empty, weights 1."""
    token_loss = -logp
    loss = aggregate_loss(token_loss, sample_index, step, loss_agg=config.loss_agg,
                          loss_agg_tokens=config.loss_agg_tokens)
    none = torch.zeros_like(logp, dtype=torch.bool)
    return MicrobatchLoss(loss, token_loss.detach(), none, none, torch.ones_like(logp.detach()), none, None)
