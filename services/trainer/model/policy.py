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

In numerics 'true_on_policy' the model runs patched onto the batch-invariant
ops (kernels/batch_invariant/hf.py) and the head is scored by
`score_hidden_batch_invariant`: bi_linear logits of the response rows, then
the log-prob kernel call the rollout engine makes on its lm_head's logits.
"""
from __future__ import annotations

import torch

from services.trainer.data.batching import Microbatch


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


BATCH_INVARIANT_CHUNK_ROWS = 1024
"""Response rows per bi_linear head call in true_on_policy: bounds the [rows, vocab] logits alive at once
(each chunk's are recomputed in backward). bi_linear is row-invariant, so the chunking changes no bit."""


def _batch_invariant_head(rows: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kernels.batch_invariant import bi_linear
    from kernels.logprob import token_logprobs_with_entropy

    return token_logprobs_with_entropy(bi_linear(rows, weight), targets, temperature=temperature)


def score_hidden_batch_invariant(hidden: torch.Tensor, weight: torch.Tensor, mask: torch.Tensor,
                                 targets: torch.Tensor, *, temperature: float,
                                 chunk_rows: int = BATCH_INVARIANT_CHUNK_ROWS,
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, lse, entropy) as `score_hidden`, every bit independent of which other rows are scored.

    The rollout engine in true_on_policy takes logits = its patched lm_head (bi_linear) of a row and
    calls kernels.logprob on them; this is that computation on the response rows: bi_linear(rows,
    weight), then the same kernel with the same (auto) backend — with entropy, whose extra output
    leaves logp and lse untouched. The fused linear head is not used: its GEMM tiling depends on the
    number of rows. Rows go in chunks, each recomputed in backward (activation checkpointing), so
    at most one chunk's logits are kept."""
    from torch.utils.checkpoint import checkpoint

    rows = hidden[mask]
    recompute = torch.is_grad_enabled() and (rows.requires_grad or weight.requires_grad)
    parts = []
    for start in range(0, max(rows.shape[0], 1), chunk_rows):
        piece, piece_targets = rows[start:start + chunk_rows], targets[start:start + chunk_rows]
        if recompute:
            parts.append(checkpoint(_batch_invariant_head, piece, weight, piece_targets, temperature,
                                    use_reentrant=False))
        else:
            parts.append(_batch_invariant_head(piece, weight, piece_targets, temperature))
    if len(parts) == 1:
        return parts[0]
    logp, lse, ent = zip(*parts)
    return torch.cat(logp), torch.cat(lse), torch.cat(ent)


class PolicyModule(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, *, numerics: str = "fast") -> None:
        super().__init__()
        self.lm = lm
        self.numerics = numerics
        """'fast' or 'true_on_policy' (TrainerRunConfig.numerics): which head `forward` scores with."""

    @property
    def config(self):
        return self.lm.config

    def forward(self, microbatch: Microbatch | None = None, *, temperature: float = 1.0, with_argmax: bool = False,
                **hf_kwargs):
        """(logp, lse, entropy) of the microbatch's response tokens; with `with_argmax` also each response
        row's most likely token (int64, no gradient), for on-policy distillation's teacher-student agreement.
        Inside forward, so that a sharded model's weights are gathered for it too."""
        if microbatch is None:
            return self.lm(**hf_kwargs)
        hidden = microbatch.hidden_states(self.lm)
        weight = self.lm.get_output_embeddings().weight
        if self.numerics == "true_on_policy":
            scored = score_hidden_batch_invariant(hidden, weight, microbatch.loss_mask, microbatch.response_targets,
                                                  temperature=temperature)
        else:
            scored = score_hidden(hidden, weight, microbatch.loss_mask, microbatch.response_targets,
                                  temperature=temperature)
        if not with_argmax:
            return scored
        return (*scored, row_argmax(hidden[microbatch.loss_mask].detach(), weight.detach(),
                                    batch_invariant=self.numerics == "true_on_policy"))


ARGMAX_CHUNK_ROWS = 1024
"""Rows per logits GEMM of row_argmax: bounds the [rows, vocab] logits alive at once."""


def row_argmax(rows: torch.Tensor, weight: torch.Tensor, *, batch_invariant: bool) -> torch.Tensor:
    """int64 [N]: argmax over the vocabulary of rows @ weight.T, chunk by chunk, no gradient. In true_on_policy
    the logits come from bi_linear, as the log-probs' do, so the argmax too is a function of the row alone."""
    with torch.no_grad():
        if batch_invariant:
            from kernels.batch_invariant import bi_linear as linear
        else:
            linear = torch.nn.functional.linear
        parts = [linear(rows[start:start + ARGMAX_CHUNK_ROWS], weight).argmax(dim=-1)
                 for start in range(0, rows.shape[0], ARGMAX_CHUNK_ROWS)]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=rows.device)
