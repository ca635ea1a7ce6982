"""What a microbatch is to the loss code, the step's canonical sample order, and the padded layout.

The training loop sees a microbatch only through the `Microbatch` protocol:
"give me the final hidden states (and which rows score response tokens), and the per-token targets,
rollout log-probs and advantages in the same order". Two layouts satisfy it: the padded one here
(right-padded rows under a token budget, `plan_padded` + `PaddedMicrobatch`) and the packed one
(services/trainer/data/packing.py, the default), so the loss code is the same for both. The run's
`trainer.batching` chooses between them (services/trainer/run_setup.py, `build_microbatches`).

Alignment: a sequence is prompt (P tokens) + response (R tokens), L = P + R.
The model reads tokens 0..L-2 and its logits at position t predict token t+1,
so response token j (at sequence position P + j) is scored by the logits at
position P + j - 1. The last token is never fed: nothing is predicted from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TrainSample:
    """One decoded, validated trajectory."""

    sample_id: str
    group_id: str
    prompt_ids: torch.Tensor        # int64 [P], P >= 1
    response_ids: torch.Tensor      # int64 [R], R >= 1
    rollout_logprobs: torch.Tensor  # float32 [M]: the model tokens' (M = R without a response_mask)
    reward: float
    advantage: float
    response_mask: torch.Tensor | None = None
    """bool [R]: True at tokens the model sampled, False at environment tokens (a multi-turn episode's
    observations), which are context only: never a loss, IW or parity term. None: all the model's."""
    staleness_sum: int = 0
    """Over the model tokens, how many policy versions each was sampled behind the trainer that trains
    it (step - 1 - the token's version), summed: 0 for a synchronous step (lr_schedule.staleness_factor)."""
    routed_experts: torch.Tensor | None = None
    """int64 [P + R, layers, top_k]: the experts the rollout routed each token to (-1: pad, the last token);
    None: none sent (services/trainer/model/moe.py checks and uses it)."""

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.numel() + self.response_ids.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.numel())

    @property
    def num_model_tokens(self) -> int:
        """Response tokens the model sampled: the ones the loss covers."""
        return self.num_response_tokens if self.response_mask is None else int(self.response_mask.sum())


class Microbatch(Protocol):
    """What the loss code needs from a microbatch, whatever its layout."""

    sample_ids: tuple[str, ...]

    @property
    def num_response_tokens(self) -> int: ...

    loss_mask: torch.Tensor  # bool, the shape of hidden_states(...) without H: True at the N response rows

    def hidden_states(self, lm: torch.nn.Module) -> torch.Tensor:
        """Final hidden states of the HF causal LM `lm` at every position ([T, H] packed, [B, T, H] padded);
        `[loss_mask]` selects the N rows that score the response tokens, in `response_targets` order."""

    @property
    def response_targets(self) -> torch.Tensor: ...        # int64 [N]

    @property
    def response_rollout_logprobs(self) -> torch.Tensor: ...  # float32 [N]

    @property
    def response_advantages(self) -> torch.Tensor: ...     # float32 [N]

    @property
    def response_sample_index(self) -> torch.Tensor: ...   # int64 [N], index in canonical_order(samples)

    @property
    def response_positions(self) -> torch.Tensor: ...      # int64 [N], position in the token's sequence

    @property
    def response_ranks(self) -> torch.Tensor: ...          # int64 [N], index among its sequence's loss tokens

    def to(self, device: torch.device | str) -> Microbatch: ...


def canonical_order(samples: list[TrainSample]) -> list[TrainSample]:
    """Longest first, ties by sample_id: independent of arrival order, tight padding.

    The trainer must give the same bits for the same set of trajectories even
    when they arrive in a different order (rollout replicas answer in any
    order), so microbatch composition never depends on the stream order.
    """
    return sorted(samples, key=lambda s: (-s.num_tokens, s.sample_id))


def plan_padded(samples: list[TrainSample], microbatch_tokens: int) -> list[list[TrainSample]]:
    """Split `samples` (already in canonical order) into padded microbatches.

    A microbatch costs rows x (longest row - 1) tokens (the last token is not
    fed). Rows are taken greedily in order; a row that would push the cost over
    the budget starts a new microbatch. A single row above the budget forms its
    own microbatch: it cannot be split, and refusing it would make a legal
    trajectory untrainable.
    """
    if microbatch_tokens < 1:
        raise ValueError(f"microbatch_tokens: must be >= 1, got {microbatch_tokens}")
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    longest = 0
    for s in samples:
        width = max(longest, s.num_tokens - 1)
        if current and (len(current) + 1) * width > microbatch_tokens:
            batches.append(current)
            current, width = [], s.num_tokens - 1
        current.append(s)
        longest = width
    if current:
        batches.append(current)
    return batches


class ResponseSelection:
    """Response-token views shared by every layout: tensors aligned to logit rows, selected by loss_mask."""

    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor

    @property
    def response_targets(self) -> torch.Tensor:
        return self.targets[self.loss_mask]

    @property
    def response_rollout_logprobs(self) -> torch.Tensor:
        return self.rollout_logprobs[self.loss_mask]

    @property
    def response_advantages(self) -> torch.Tensor:
        return self.advantages[self.loss_mask]

    @property
    def response_ranks(self) -> torch.Tensor:
        """Index of each loss token among its own sequence's loss tokens (0, 1, ... per sequence). A
        sequence's loss tokens are contiguous and in order in every layout, so a rank restarts where the
        sample index changes."""
        idx = self.response_sample_index
        pos = torch.arange(idx.numel(), device=idx.device)
        starts = torch.ones_like(idx, dtype=torch.bool)
        starts[1:] = idx[1:] != idx[:-1]
        return pos - torch.cummax(torch.where(starts, pos, torch.zeros_like(pos)), 0).values


@dataclass(frozen=True)
class PaddedMicrobatch(ResponseSelection):
    """Right-padded rows. Right padding needs no attention mask: attention is
    causal, so every real token only sees positions at or before it, all real;
    the padding after a row's end is never attended to by that row's tokens."""

    input_ids: torch.Tensor         # int64 [B, T], T = longest L - 1
    targets: torch.Tensor           # int64 [B, T]: targets[b, t] = token t+1 of row b
    loss_mask: torch.Tensor         # bool  [B, T]: True where targets[b, t] is a response token
    rollout_logprobs: torch.Tensor  # float32 [B, T], 0 outside the mask
    advantages: torch.Tensor        # float32 [B, T], the row's advantage inside the mask, 0 outside
    sample_ids: tuple[str, ...]
    row_sample_index: torch.Tensor  # int64 [B]: index of each row's sample in the step's canonical order

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    @property
    def num_padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    def hidden_states(self, lm: torch.nn.Module) -> torch.Tensor:
        return lm.model(input_ids=self.input_ids, use_cache=False).last_hidden_state

    @property
    def response_sample_index(self) -> torch.Tensor:
        """Step-level sample index of each response token (for the parity gate's diagnostic)."""
        return self.row_sample_index[:, None].expand_as(self.loss_mask)[self.loss_mask]

    @property
    def response_positions(self) -> torch.Tensor:
        """Position of each response token in its sequence (row t predicts token t + 1)."""
        cols = torch.arange(1, self.loss_mask.shape[1] + 1, device=self.loss_mask.device)
        return cols[None, :].expand_as(self.loss_mask)[self.loss_mask]

    def to(self, device: torch.device | str) -> PaddedMicrobatch:
        return PaddedMicrobatch(
            input_ids=self.input_ids.to(device),
            targets=self.targets.to(device),
            loss_mask=self.loss_mask.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            advantages=self.advantages.to(device),
            sample_ids=self.sample_ids,
            row_sample_index=self.row_sample_index.to(device),
        )


def collate_padded(samples: list[TrainSample], *, pad_id: int = 0, first_index: int = 0) -> PaddedMicrobatch:
    """Build one right-padded microbatch. `pad_id` only fills positions no real token sees."""
    if not samples:
        raise ValueError("collate_padded: empty microbatch")
    width = max(s.num_tokens for s in samples) - 1
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    targets = torch.full((b, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, width), dtype=torch.bool)
    rollout = torch.zeros((b, width), dtype=torch.float32)
    adv = torch.zeros((b, width), dtype=torch.float32)
    for row, s in enumerate(samples):
        full = torch.cat([s.prompt_ids, s.response_ids]).long()
        n = full.numel() - 1
        p = s.prompt_ids.numel()
        input_ids[row, :n] = full[:-1]
        targets[row, :n] = full[1:]
        # Positions p-1 .. n-1 predict response tokens 0 .. R-1; environment tokens are not scored.
        model = torch.ones(n - p + 1, dtype=torch.bool) if s.response_mask is None else s.response_mask.bool()
        loss_mask[row, p - 1 : n] = model
        rollout[row, p - 1 : n][model] = s.rollout_logprobs
        adv[row, p - 1 : n][model] = s.advantage
    return PaddedMicrobatch(input_ids, targets, loss_mask, rollout, adv, tuple(s.sample_id for s in samples),
                            torch.arange(first_index, first_index + b))


def padded_microbatches(samples: list[TrainSample], microbatch_tokens: int) -> list[PaddedMicrobatch]:
    """Canonical order -> budgeted plan -> padded tensors."""
    out: list[PaddedMicrobatch] = []
    first = 0
    for group in plan_padded(canonical_order(samples), microbatch_tokens):
        out.append(collate_padded(group, first_index=first))
        first += len(group)
    return out
