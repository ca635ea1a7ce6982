"""Packing samples into microbatches: first-fit decreasing under a token budget.

A pure function (`pack_samples`) from a list of samples to a list of
microbatches. Each microbatch is one flat buffer of whole sequences
(prompt + response), no padding, with:

    input_ids        int64 [T]   the sequences back to back
    position_ids     int64 [T]   restarting at 0 for every sequence (RoPE sees what the rollout saw)
    cu_seqlens       int32 [N+1] sequence boundaries for varlen attention (kernels.attention)
    max_seqlen       int         longest sequence (a Python int: no device sync per layer)

and per-token arrays aligned with the *logit rows* (row t of the model's output
predicts the token at t + 1 of the same sequence), so the trainer never shifts:

    targets          int64 [T]   input_ids[t + 1] within the sequence; 0 at each sequence's last token
    loss_mask        bool  [T]   True iff targets[t] is a response token
    rollout_logprobs fp32  [T]   the rollout's log-prob of targets[t] (0 where loss_mask is False)
    advantages       fp32  [T]   the sample's advantage (0 where loss_mask is False)
    sample_index     int64 [T]   index of the token's sample in the input list

Trainer usage:
    mb = mb.to(device)
    logits = model(input_ids=mb.input_ids[None], **mb.model_kwargs()).logits[0]          # [T, V]
    logp, _ = token_logprobs(logits, mb.targets, temperature=tau)                          # [T]
    ... loss over mb.loss_mask, IW = exp(logp - mb.rollout_logprobs)

Packing order is deterministic: lengths sorted descending with ties broken by
input index, each sequence placed into the first microbatch it fits, and the
sequences inside a microbatch kept in input order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field


class PackingConfig(BaseModel):
    """How a step's samples become microbatches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_budget: int = Field(
        16384, gt=0,
        description="Most tokens (prompt + response, all sequences) in one microbatch; bounds activation memory. "
        "A single sample longer than this is an error, never truncated.",
    )


@dataclass(frozen=True)
class PackSample:
    """One trajectory as the trainer receives it."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    rollout_logprobs: Sequence[float]
    """fp32 log-prob of each response token under the distribution it was sampled from (len == response)."""
    advantage: float

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass(frozen=True)
class PackedMicrobatch:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    sample_index: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    samples: tuple[int, ...]
    """Input indices of the packed sequences, in buffer order (sequence i is samples[i])."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_sequences(self) -> int:
        return len(self.samples)

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> "PackedMicrobatch":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        return PackedMicrobatch(**moved)

    def model_kwargs(self) -> dict:
        """kwargs for an HF causal LM running the 'lockstep_packed' attention (besides input_ids[None])."""
        from kernels.attention.hf import packed_forward_kwargs

        return packed_forward_kwargs(self.position_ids, self.cu_seqlens, self.max_seqlen)


def plan_microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: lists of indices into `lengths`, each list summing to <= token_budget.

    Each list is in ascending index order; lists are in the order they were opened.
    """
    too_long = [i for i, n in enumerate(lengths) if n > token_budget]
    if too_long:
        i = too_long[0]
        raise ValueError(f"sample {i} has {lengths[i]} tokens, more than token_budget={token_budget} "
                         f"({len(too_long)} such samples); raise the budget or cap generation length")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for b, room in enumerate(free):
            if lengths[i] <= room:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(token_budget - lengths[i])
    return [sorted(b) for b in bins]


def _validate(i: int, s: PackSample) -> None:
    if len(s.prompt_ids) < 1:
        raise ValueError(f"sample {i}: empty prompt (the first response token needs a position to be predicted from)")
    if len(s.response_ids) < 1:
        raise ValueError(f"sample {i}: empty response")
    if len(s.rollout_logprobs) != len(s.response_ids):
        raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout log-probs for "
                         f"{len(s.response_ids)} response tokens")
    if not math.isfinite(s.advantage):
        raise ValueError(f"sample {i}: advantage {s.advantage} is not finite")


def pack_samples(samples: Sequence[PackSample], config: PackingConfig = PackingConfig()) -> list[PackedMicrobatch]:
    """Pack `samples` into microbatches (see the module doc for layout and alignment). Pure; CPU tensors out."""
    if not samples:
        raise ValueError("pack_samples: no samples")
    for i, s in enumerate(samples):
        _validate(i, s)
    out = []
    for members in plan_microbatches([s.length for s in samples], config.token_budget):
        out.append(_build(samples, members))
    return out


def _build(samples: Sequence[PackSample], members: list[int]) -> PackedMicrobatch:
    lengths = [samples[i].length for i in members]
    total = sum(lengths)
    input_ids = torch.empty(total, dtype=torch.int64)
    position_ids = torch.empty(total, dtype=torch.int64)
    targets = torch.zeros(total, dtype=torch.int64)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    rollout = torch.zeros(total, dtype=torch.float32)
    adv = torch.zeros(total, dtype=torch.float32)
    sample_index = torch.empty(total, dtype=torch.int64)
    cu = [0]
    for i, length in zip(members, lengths):
        s, start = samples[i], cu[-1]
        p, r = len(s.prompt_ids), len(s.response_ids)
        seq = torch.tensor([*s.prompt_ids, *s.response_ids], dtype=torch.int64)
        input_ids[start:start + length] = seq
        position_ids[start:start + length] = torch.arange(length)
        targets[start:start + length - 1] = seq[1:]
        # Response token j sits at sequence position p + j and is predicted by the row before it.
        rows = slice(start + p - 1, start + p - 1 + r)
        loss_mask[rows] = True
        rollout[rows] = torch.tensor(list(s.rollout_logprobs), dtype=torch.float32)
        adv[rows] = float(s.advantage)
        sample_index[start:start + length] = i
        cu.append(start + length)
    if not bool(torch.isfinite(rollout).all()):
        bad = int(sample_index[~torch.isfinite(rollout)][0])
        raise ValueError(f"sample {bad}: non-finite rollout log-prob")
    return PackedMicrobatch(
        input_ids=input_ids, position_ids=position_ids, targets=targets, loss_mask=loss_mask,
        rollout_logprobs=rollout, advantages=adv, sample_index=sample_index,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(lengths), samples=tuple(members))
