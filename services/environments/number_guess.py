"""The `number_guess` environment: a task that needs several turns of feedback.

The problem's answer is a hidden integer. Each model turn's first integer is a guess: the observation says
`higher` or `lower`, or `no number` for a turn without one (reward 0, the episode goes on); the right
guess ends the episode with reward `correct_reward`. A policy that uses the feedback (bisection) wins in
about log2(range) turns; one that ignores it rarely does within max_turns.
"""
from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

from contract.environment import Environment, EpisodeProblem, StepResult

_INTEGER = re.compile(r"-?\d{1,12}")


class GuessOptions(BaseModel):
    """Options of the `number_guess` environment."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    correct_reward: float = Field(1.0, ge=0.0, le=1.0, description="Reward of the right guess.")


class GuessEnvironment(Environment):
    def __init__(self, options: GuessOptions):
        self.options = options
        self.target = 0

    def reset(self, problem: EpisodeProblem) -> str:
        self.target = int(problem.answer)
        return problem.prompt

    def step(self, model_turn: str) -> StepResult:
        found = _INTEGER.search(model_turn)
        if found is None:
            return StepResult(" no number: ", 0.0, False)
        guess = int(found.group(0))
        if guess == self.target:
            return StepResult("", self.options.correct_reward, True)
        return StepResult(" higher: " if guess < self.target else " lower: ", 0.0, False)

