"""Packing samples into microbatches: first-fit decreasing under a token budget.

A pure function (`pack_samples`) from a list of samples to a list of
microbatches. Each microbatch is one flat buffer of whole sequences, no
padding. A sample of L = P + R tokens (prompt + response) contributes its
first L - 1 tokens: nothing is predicted from the last one (the same choice as
services/trainer/data/batching.py), so every row has a target. Per microbatch:

    input_ids        int64 [T]   the sequences back to back
    position_ids     int64 [T]   restarting at 0 for every sequence (RoPE sees what the rollout saw)
    cu_seqlens       int32 [N+1] sequence boundaries for varlen attention (kernels.attention)
    max_seqlen       int         longest sequence (a Python int: no device sync per layer)

and per-row arrays aligned with the *logit rows* (row t predicts the token at
t + 1 of the same sample), so the trainer never shifts:

    targets          int64 [T]   the token row t predicts
    loss_mask        bool  [T]   True iff targets[t] is a response token
    rollout_logprobs fp32  [T]   the rollout's log-prob of targets[t] (0 where loss_mask is False)
    advantages       fp32  [T]   the sample's advantage (0 where loss_mask is False)
    sample_index     int64 [T]   index of the row's sample in the input list

`PackedMicrobatch` satisfies services/trainer/data/batching.py's `Microbatch`
protocol (hidden_states / response_targets / response_rollout_logprobs /
response_advantages / sample_ids / num_response_tokens / to), so the loss code
is the same for padded and packed microbatches. Its `hidden_states` refuses
a model whose attention is not the registry's ('lockstep_packed'): a packed
buffer through an attention that ignores cu_seqlens lets tokens attend across
sequences (step-1 IW mean 0.41 on a Qwen3-8B run, with rewards looking fine).

Determinism: the plan depends only on the lengths and the input order (ties
by input index); pass samples in a canonical order (batching.canonical_order)
and the same set of trajectories packs the same way whatever order it arrived in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Protocol, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from services.trainer.data.batching import ResponseSelection


class PackingConfig(BaseModel):
    """How a step's samples become microbatches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_budget: int = Field(
        16384, gt=0,
        description="Most tokens fed to the model in one microbatch (sum over its sequences of L - 1); bounds "
        "activation memory. A single sample above it is an error, never truncated.",
    )


class SampleLike(Protocol):
    """What packing reads from a sample; batching.TrainSample and PackSample both qualify."""

    prompt_ids: Sequence[int] | torch.Tensor
    response_ids: Sequence[int] | torch.Tensor
    rollout_logprobs: Sequence[float] | torch.Tensor
    advantage: float
    # Optional (getattr, default None): bool [R], False at environment tokens (see batching.TrainSample).
    # response_mask: Sequence[bool] | torch.Tensor | None


def model_token_mask(sample: SampleLike) -> torch.Tensor:
    """bool [R]: True at the response tokens the model sampled (all of them without a response_mask)."""
    mask = getattr(sample, "response_mask", None)
    if mask is None:
        return torch.ones(len(sample.response_ids), dtype=torch.bool)
    return torch.as_tensor(mask, dtype=torch.bool).reshape(-1)


@dataclass(frozen=True)
class PackSample:
    """One trajectory (plain Python form, for tests and tools)."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    rollout_logprobs: Sequence[float]
    """fp32 log-prob of each model token under the distribution it was sampled from (len == model tokens)."""
    advantage: float
    sample_id: str = ""
    response_mask: Sequence[bool] | None = None
    """False at environment tokens (context only); None: every response token is the model's."""


def fed_length(sample: SampleLike) -> int:
    """Tokens the model reads for this sample: all but the last."""
    return len(sample.prompt_ids) + len(sample.response_ids) - 1


@dataclass(frozen=True)
class PackedMicrobatch(ResponseSelection):
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
    sample_ids: tuple[str, ...]
    """sample_id of each packed sequence, in buffer order (the index as a string when a sample has none)."""

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
                moved[name] = value.to(device)
        return PackedMicrobatch(**moved)

    def model_kwargs(self) -> dict:
        """kwargs for an HF causal LM on the 'lockstep_packed' attention, besides input_ids=self.input_ids[None]."""
        from kernels.attention.hf import packed_forward_kwargs

        return packed_forward_kwargs(self.position_ids, self.cu_seqlens, self.max_seqlen)

    # ---- batching.Microbatch protocol --------------------------------------------------------
    def hidden_states(self, lm: torch.nn.Module) -> torch.Tensor:
        from kernels.attention.hf import HF_ATTN_IMPLEMENTATION

        impl = getattr(getattr(lm, "config", None), "_attn_implementation", None)
        if impl != HF_ATTN_IMPLEMENTATION:
            raise RuntimeError(
                f"packed microbatch refused: the model's attention is {impl!r}, not {HF_ATTN_IMPLEMENTATION!r}. "
                "Call kernels.attention.register_hf_attention() and model.set_attn_implementation(...) first; "
                "another attention may ignore cu_seqlens and attend across packed sequences.")
        return lm.model(input_ids=self.input_ids[None], use_cache=False, **self.model_kwargs()).last_hidden_state[0]

    @property
    def response_sample_index(self) -> torch.Tensor:
        """Input index of each response token's sample (for the parity gate's diagnostic)."""
        return self.sample_index[self.loss_mask]

    @property
    def response_positions(self) -> torch.Tensor:
        """Position of each response token in its sample's sequence (prompt tokens count; first is 0)."""
        return self.position_ids[self.loss_mask] + 1


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


def _validate(i: int, s: SampleLike) -> None:
    if len(s.prompt_ids) < 1:
        raise ValueError(f"sample {i}: empty prompt (the first response token needs a position to be predicted from)")
    if len(s.response_ids) < 1:
        raise ValueError(f"sample {i}: empty response")
    mask = model_token_mask(s)
    if mask.numel() != len(s.response_ids):
        raise ValueError(f"sample {i}: response_mask of {mask.numel()} for {len(s.response_ids)} response tokens")
    if not bool(mask.any()):
        raise ValueError(f"sample {i}: no model token in the response")
    if len(s.rollout_logprobs) != int(mask.sum()):
        what = "response" if getattr(s, "response_mask", None) is None else "model"
        raise ValueError(f"sample {i}: {len(s.rollout_logprobs)} rollout log-probs for "
                         f"{int(mask.sum())} {what} tokens")
    if not math.isfinite(float(s.advantage)):
        raise ValueError(f"sample {i}: advantage {s.advantage} is not finite")


def pack_samples(samples: Sequence[SampleLike], config: PackingConfig = PackingConfig()) -> list[PackedMicrobatch]:
    """Pack `samples` into microbatches (see the module doc for layout and alignment). Pure; CPU tensors out."""
    if not samples:
        raise ValueError("pack_samples: no samples")
    for i, s in enumerate(samples):
        _validate(i, s)
    plan = plan_microbatches([fed_length(s) for s in samples], config.token_budget)
    return [_build(samples, members) for members in plan]


def _build(samples: Sequence[SampleLike], members: list[int]) -> PackedMicrobatch:
    lengths = [fed_length(samples[i]) for i in members]
    total = sum(lengths)
    input_ids = torch.empty(total, dtype=torch.int64)
    position_ids = torch.empty(total, dtype=torch.int64)
    targets = torch.empty(total, dtype=torch.int64)
    loss_mask = torch.zeros(total, dtype=torch.bool)
    rollout = torch.zeros(total, dtype=torch.float32)
    adv = torch.zeros(total, dtype=torch.float32)
    sample_index = torch.empty(total, dtype=torch.int64)
    cu = [0]
    for i, n in zip(members, lengths):
        s, start = samples[i], cu[-1]
        p, r = len(s.prompt_ids), len(s.response_ids)
        full = torch.cat([torch.as_tensor(s.prompt_ids, dtype=torch.int64).reshape(-1),
                          torch.as_tensor(s.response_ids, dtype=torch.int64).reshape(-1)])
        input_ids[start:start + n] = full[:-1]
        targets[start:start + n] = full[1:]
        position_ids[start:start + n] = torch.arange(n)
        # Response token j sits at sequence position p + j and is predicted by row p - 1 + j. Environment
        # tokens are read like any other but predicted by no loss row.
        rows = torch.arange(start + p - 1, start + p - 1 + r)[model_token_mask(s)]
        loss_mask[rows] = True
        rollout[rows] = torch.as_tensor(s.rollout_logprobs, dtype=torch.float32).reshape(-1)
        adv[rows] = float(s.advantage)
        sample_index[start:start + n] = i
        cu.append(start + n)
    if not bool(torch.isfinite(rollout).all()):
        bad = int(sample_index[~torch.isfinite(rollout)][0])
        raise ValueError(f"sample {bad}: non-finite rollout log-prob")
    return PackedMicrobatch(
        input_ids=input_ids, position_ids=position_ids, targets=targets, loss_mask=loss_mask,
        rollout_logprobs=rollout, advantages=adv, sample_index=sample_index,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(lengths), samples=tuple(members),
        sample_ids=tuple(str(getattr(samples[i], "sample_id", "") or i) for i in members))
