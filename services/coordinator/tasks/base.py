"""The verifiable-task interface the coordinator samples prompts from and scores with."""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    problem_id: str   # stable id, unique within the task
    prompt: str       # text given to the policy (the tokenizer adds nothing)
    answer: str       # reference answer the reward checks against
    messages: tuple[tuple[str, str], ...] | None = None
    """A chat prompt's (role, content) messages, rendered through the model's chat template (the run's
    PromptTokens does it); then `prompt` is only its last message's content, for reading."""


class Task(abc.ABC):
    name: str = "abstract"
    success_reward: float = 1.0
    """A response whose reward is at least this counts as correct (pass@k); rewards are 1.0 or 0.0 by default."""

    @abc.abstractmethod
    def split(self, name: str) -> Sequence[Problem]:
        """'train' or 'heldout'; the two never share a problem. Deterministic."""

    @abc.abstractmethod
    def reward(self, problem: Problem, response_text: str) -> float:
        """Verifiable reward of one response (1.0 correct, 0.0 otherwise unless documented)."""

    async def score(self, items: Sequence[tuple[Problem, str]]) -> list[float]:
        """Rewards of many responses; what the run loop calls. Tasks whose reward is costly or
        untrusted (parsing model output with sympy) run it elsewhere; the default runs it inline."""
        return [self.reward(problem, text) for problem, text in items]

    async def score_with_metrics(self, items: Sequence[tuple[Problem, str]]
                                 ) -> tuple[list[float], dict[str, float | list[str]]]:
        """score()'s rewards and the task's own numbers about these responses (the code task's outcomes): counts,
        summed into the step's metrics, and per-response lists, joined in scoring order; none by default."""
        return await self.score(items), {}

    def close(self) -> None:
        """Release what score() holds (worker processes); the run is over."""
