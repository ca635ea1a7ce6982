"""Tasks whose samples are multi-turn episodes: the environment writes the prompt and the rewards.

An `EpisodicTask` names a registered environment (services/environments/registry.py) and the episode limits
(`options.episode`); the coordinator sends each problem to the rollout, which runs the episode turn by
turn and returns the environment's reward with the trajectory. Built in:

- `calculator`: `a*b=` problems; the model may call `<calc>EXPR</calc>` before it answers (environment
  `calculator`); reward 1.0 for the right product.
- `number_guess`: find a hidden integer in [0, max_value] from `higher`/`lower` feedback (environment
  `number_guess`); reward 1.0 for finding it.

Both splits are pure functions of the options (seed included); held-out and train problems never share
an answer-defining pair (calculator: the unordered operand pair; number_guess: the hidden number).
"""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import cached_property

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contract.environment import EpisodeLimits
from proto import lockstep_pb2 as pb
from services.coordinator.tasks.base import Problem, Task


class EpisodicTask(Task):
    """Rewards come with the samples (pb.Sample.episode_reward), never from reading response text."""

    environment: str = "abstract"
    episode: EpisodeLimits
    environment_options: dict

    def episode_settings(self) -> pb.EpisodeSettings:
        return pb.EpisodeSettings(environment=self.environment, options_json=json.dumps(self.environment_options),
                                  limits_json=self.episode.model_dump_json())

    def reward(self, problem: Problem, response_text: str) -> float:
        raise RuntimeError(f"task {self.name!r}: rewards come from its environment's episodes, not from text")

    async def score(self, items: Sequence[tuple[Problem, str]]) -> list[float]:
        raise RuntimeError(f"task {self.name!r}: rewards come from its environment's episodes, not from text")


class _EpisodicConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    seed: int = Field(0, ge=0, le=2**62, description="Seeds the draw of both splits.")
    heldout_size: int = Field(100, ge=1, le=10_000, description="Problems in the held-out split.")
    episode: EpisodeLimits = Field(default_factory=EpisodeLimits, description="Limits of every episode: "
                                   "max_turns, max_episode_tokens, step_timeout_s, max_observation_bytes.")


class CalculatorConfig(_EpisodicConfig):
    """The run spec's task.options for `calculator`."""

    digits: int = Field(2, ge=1, le=4, description="Digits per operand of `a*b=`.")
    train_size: int = Field(2000, ge=1, le=100_000, description="Problems in the train split, capped by how "
                            "many unordered operand pairs remain.")

    @model_validator(mode="after")
    def _leaves_training_problems(self) -> "CalculatorConfig":
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        pairs = (hi - lo + 1) * (hi - lo + 2) // 2
        if self.heldout_size >= pairs:
            raise ValueError(f"heldout_size: {self.heldout_size} leaves no training problems ({pairs} pairs)")
        return self


class GuessConfig(_EpisodicConfig):
    """The run spec's task.options for `number_guess`."""

    max_value: int = Field(99, ge=1, le=10**9, description="Hidden numbers are drawn from 0..max_value.")
    heldout_size: int = Field(20, ge=1, le=10_000, description="Problems in the held-out split.")

    @model_validator(mode="after")
    def _leaves_training_problems(self) -> "GuessConfig":
        if self.heldout_size > self.max_value:
            raise ValueError(f"heldout_size: {self.heldout_size} leaves no training problems "
                             f"({self.max_value + 1} numbers)")
        return self


class CalculatorTask(EpisodicTask):
    name = "calculator"
    environment = "calculator"

    def __init__(self, config: CalculatorConfig):
        self.config, self.episode, self.environment_options = config, config.episode, {}

    @cached_property
    def _splits(self) -> dict[str, tuple[Problem, ...]]:
        cfg = self.config
        lo, hi = 10 ** (cfg.digits - 1), 10**cfg.digits - 1
        rng = random.Random(f"calculator/{cfg.seed}/{cfg.digits}")
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]
        rng.shuffle(pairs)
        held, train = pairs[:cfg.heldout_size], pairs[cfg.heldout_size:cfg.heldout_size + cfg.train_size]

        def problems(split: str, chosen: list[tuple[int, int]]) -> tuple[Problem, ...]:
            out = []
            for i, (a, b) in enumerate(chosen):
                a, b = (a, b) if rng.random() < 0.5 else (b, a)
                out.append(Problem(f"{split}-{i:06d}-{a}*{b}", f"{a}*{b}=", str(a * b)))
            return tuple(out)

        return {"heldout": problems("heldout", held), "train": problems("train", train)}

    def split(self, name: str) -> tuple[Problem, ...]:
        try:
            return self._splits[name]
        except KeyError:
            raise ValueError(f"split: unknown {name!r}, expected 'train' or 'heldout'") from None


class GuessTask(EpisodicTask):
    name = "number_guess"
    environment = "number_guess"

    def __init__(self, config: GuessConfig):
        self.config, self.episode, self.environment_options = config, config.episode, {}

    @cached_property
    def _splits(self) -> dict[str, tuple[Problem, ...]]:
        cfg = self.config
        rng = random.Random(f"number_guess/{cfg.seed}/{cfg.max_value}")
        held = rng.sample(range(cfg.max_value + 1), cfg.heldout_size)
        taken = set(held)
        train = [n for n in range(min(cfg.max_value + 1, 200_000)) if n not in taken]
        rng.shuffle(train)
        prompt = f"guess 0-{cfg.max_value}:"
        return {"heldout": tuple(Problem(f"heldout-{i:06d}", prompt, str(n)) for i, n in enumerate(held)),
                "train": tuple(Problem(f"train-{i:06d}", prompt, str(n)) for i, n in enumerate(train))}

    def split(self, name: str) -> tuple[Problem, ...]:
        try:
            return self._splits[name]
        except KeyError:
            raise ValueError(f"split: unknown {name!r}, expected 'train' or 'heldout'") from None


def episode_metrics(samples: Sequence[pb.Sample]) -> dict[str, float]:
    """A step's episodes in numbers: turns and tokens per episode, the model's share of the tokens, and how
    many ended for each reason (`episodes_end_<reason>`, every reason of contract.environment.EndReason
    present, 0 when none ended so)."""
    from contract.environment import EndReason

    n = len(samples)
    turns = [s.turns for s in samples]
    tokens = [(s.prompt_token_ids.shape[0] if s.prompt_token_ids.shape else 0)
              + (s.response_token_ids.shape[0] if s.response_token_ids.shape else 0) for s in samples]
    model = sum(len(s.policy_versions) for s in samples)
    response = sum(s.response_token_ids.shape[0] if s.response_token_ids.shape else 0 for s in samples)
    out = {"episodes": float(n), "episode_turns_mean": sum(turns) / max(n, 1),
           "episode_turns_max": float(max(turns, default=0)), "episode_tokens_mean": sum(tokens) / max(n, 1),
           "episode_model_token_fraction": model / max(response, 1),
           "episode_tool_calls_mean": sum(s.tool_calls for s in samples) / max(n, 1),
           "episode_tool_errors": float(sum(s.tool_errors for s in samples))}
    for reason in EndReason:
        out[f"episodes_end_{reason.value}"] = float(sum(1 for s in samples if s.end_reason == reason.value))
    return out
