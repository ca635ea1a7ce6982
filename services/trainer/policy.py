"""The policy as the trainer runs it: a Hugging Face causal LM whose head scores response tokens.

`PolicyModule` holds the HF model and is the root FSDP unit (embeddings,
final norm and lm_head live there; decoder layers are units of their own),
so one module call covers the whole path from token ids to a token's
log-prob. Called with a microbatch it runs the backbone and scores the
response positions with the lm_head through the log-prob head
(`score_hidden`): in 16-bit compute neither the [T, V] logits of the buffer
nor the [N, V] logits of the response rows are ever built. Called with
Hugging Face arguments it is the HF model (`.logits` and all), for callers
that want plain logits.
"""
from __future__ import annotations

import torch

from services.trainer.batching import Microbatch


def score_hidden(hidden: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor, *,
                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, lse, entropy) of `targets` under logits = hidden[mask] @ weight.T, through the shared log-prob kernel.

    16-bit compute (every GPU run) goes through the fused head on the response rows only: logits one
    [chunk, vocab block] piece at a time, recomputed in backward, never [N, V]. float32 (CPU runs)
    projects every row in one GEMM and then selects, exactly as the Hugging Face head always did, so
    float32 runs keep their bits (d(W) sums over the same rows in the same GEMM); both give the kernel's
    log-probs of the same logits (the fused head's contract, tested against the unfused path)."""
    from kernels.logprob import linear_token_logprobs, token_logprobs_with_entropy

    if hidden.dtype == torch.float32:
        return token_logprobs_with_entropy(torch.nn.functional.linear(hidden, weight)[mask], targets,
                                           temperature=temperature)
    return linear_token_logprobs(hidden[mask], weight, targets, temperature=temperature, with_entropy=True)


class PolicyModule(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    @property
    def config(self):
        return self.lm.config

    def forward(self, microbatch: Microbatch | None = None, *, temperature: float = 1.0, **hf_kwargs):
        if microbatch is None:
            return self.lm(**hf_kwargs)
        hidden = microbatch.hidden_states(self.lm)
        weight = self.lm.get_output_embeddings().weight
        return score_hidden(hidden, weight, microbatch.loss_mask, microbatch.response_targets, temperature=temperature)
