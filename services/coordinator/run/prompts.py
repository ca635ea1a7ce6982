"""Which prompts a step trains on: a pure function of (seed, step).

A restarted coordinator re-derives the same batch for a step, and two runs with
the same seed see the same prompts in the same order.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from proto import lockstep_pb2 as pb
from services.coordinator.tasks.base import Problem


def derived_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # non-negative int63


def step_problems(train: Sequence[Problem], *, seed: int, step: int, count: int, round: int = 0) -> list[Problem]:
    """`count` distinct problems when the split allows, else sampled with replacement.

    `round` > 0 is a further, independent draw for the same step (dynamic sampling's extra rounds)."""
    rng = random.Random(derived_seed("prompts", seed, step) if round == 0 else derived_seed("prompts", seed, step, round))
    if count <= len(train):
        return [train[i] for i in rng.sample(range(len(train)), count)]
    return [train[rng.randrange(len(train))] for _ in range(count)]


def group_id(step: int, index: int) -> str:
    return f"s{step}-g{index}"


@dataclass(frozen=True)
class SamplingPlan:
    """How one batch of prompts is sampled: the engine's parameters, samples per prompt, and the seed of
    the prompt at index i of the batch, derived_seed(*seed_parts, i)."""

    params: pb.SamplingParams
    samples_per_prompt: int
    seed_parts: tuple[object, ...]
    episode: pb.EpisodeSettings | None = None
    """Set for an episodic task: every sample is a multi-turn episode of this environment."""

    def seed(self, index: int) -> int:
        return derived_seed(*self.seed_parts, index)
