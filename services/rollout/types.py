"""The rollout's value types: what a generation request asks for and what an engine answers.

Plain dataclasses with no engine behind them, so the wire conversion, the episode runner and every engine
import them without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the field for any out-of-range value."""
        if not self.greedy and not (self.temperature > 0 and self.temperature < float("inf")):
            raise ValueError(f"sampling.temperature: must be > 0 and finite, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"sampling.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k: must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}")

    @property
    def logprob_temperature(self) -> float:
        """Temperature of the distribution whose log-probs are reported (1 when greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass(frozen=True)
class PromptSpec:
    group_id: str
    token_ids: tuple[int, ...]
    seed: int  # sample i of this prompt is drawn with seed + i


@dataclass(frozen=True)
class ResumedSample:
    """A sample paused earlier: its tokens so far, their log-probs and the policy version of each."""

    sample_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_versions: tuple[int, ...]


@dataclass(frozen=True)
class GenerationRequest:
    prompts: tuple[PromptSpec, ...]
    sampling: SamplingConfig
    samples_per_prompt: int = 1
    resumed: tuple[ResumedSample, ...] = ()
    sample_ids: tuple[str, ...] = ()  # non-empty: only these samples are generated (GenerateRequest.sample_ids)

    def sequences(self) -> list[tuple[PromptSpec, int]]:
        """(prompt, sample index) of every sample to generate, in prompt then index order."""
        wanted = set(self.sample_ids)
        return [(p, i) for p in self.prompts for i in range(self.samples_per_prompt)
                if not wanted or f"{p.group_id}/{i}" in wanted]


@dataclass
class GeneratedSample:
    group_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]  # fp32 log-prob of each token under the sampled distribution
    finish_reason: str     # "stop" | "length" | "paused"
    policy_versions: list[int] = field(default_factory=list)  # of each token; empty: all the engine's version
    routed_experts: Any = None
    """MoE only: uint8/int32 tensor [prompt + tokens, layers, k], the experts each token was read through
    (services/rollout/embedded/routing_record.py); None: the engine recorded none."""

    @property
    def sample_id(self) -> str:
        return f"{self.group_id}/{self.index}"


@dataclass
class PrefillCounts:
    """An engine's prefill work over some requests (exported as rollout metrics)."""

    prefill_tokens: int = 0
    """Tokens run through prefill forwards (K/V computed)."""
    reused_tokens: int = 0
    """Context tokens of episode turns whose K/V was kept from the episode's previous turn (not prefilled)."""
    misses: dict[str, int] = field(default_factory=dict)
    """Episode turns that re-prefilled a context whose earlier K/V had been kept, by why it was gone."""


def check_request_fits_model(request: "GenerationRequest", *, vocab: int, max_len: int | None) -> None:
    """What every engine checks against its model: the sampling settings, at least one prompt and one
    sample, every prompt and resumed token id inside the `vocab`, and every prompt plus its new tokens
    within `max_len` positions (None: no limit). ValueError names the field."""
    request.sampling.validate()
    if request.samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt: must be >= 1, got {request.samples_per_prompt}")
    if not request.prompts:
        raise ValueError("prompts: empty")
    for i, p in enumerate(request.prompts):
        if not p.token_ids:
            raise ValueError(f"prompts[{i}].token_ids: empty")
        bad = [t for t in p.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompts[{i}].token_ids: id {bad[0]} outside the vocabulary [0, {vocab})")
        if max_len is not None and len(p.token_ids) + request.sampling.max_new_tokens > max_len:
            raise ValueError(
                f"sampling.max_new_tokens: prompts[{i}] has {len(p.token_ids)} tokens; plus "
                f"{request.sampling.max_new_tokens} new tokens exceeds max_position_embeddings={max_len}"
            )
    for i, r in enumerate(request.resumed):
        bad = [t for t in r.token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"resumed[{i}].response_token_ids: id {bad[0]} outside the vocabulary [0, {vocab})")
