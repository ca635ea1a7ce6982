"""The tiny tool-use demo: GRPO over calculator episodes with a tiny Qwen3 policy.

The policy sees `a*b=` with 3-digit operands, a product a 2-layer, 128-wide
character model cannot compute in its head. It may call the `calculator`
environment's tool, `<calc>a*b</calc>`; the environment answers
`<result>N</result>` as environment tokens (masked out of the loss), and the
policy's next turn is its answer. Reward 1 when the answer is the product.

What this package pins, so every part agrees:
- `MODEL`: the tiny Qwen3 shape (the same one as recipes/tiny_arith);
- `TASK_OPTIONS`: the calculator task's options. recipe.yaml's `task.options`
  must be exactly these (a test checks it): the warm start trains on the
  task's train split, and other options could hold out problems it saw;
- `WarmStartConfig`: the supervised warm start (prepare.py runs it).

Why the warm start is built this way: it shows the tool-call format on a
small share of its examples only (`tool_fraction`); the rest answer directly
with the true product, which the model cannot learn to compute. So the
warm-started policy has the tool-call format but rarely chooses it: greedy
decoding answers directly and is almost always wrong, while temperature-1
samples call the tool now and then, and those episodes are the ones rewarded.
RL has a real decision to learn from reward alone: call the tool.
"""
from __future__ import annotations

from dataclasses import dataclass

from recipes.tiny_arith import MODEL  # the same tiny Qwen3 shape as the single-turn demo

EPISODE_LIMITS: dict = {"max_turns": 3, "max_episode_tokens": 96, "step_timeout_s": 10.0}
"""Prompt (8) + call (20 + eos) + result (<= 23) + answer (<= 6 + eos) = 59 tokens at most on the
intended path; 3 turns leave room for one extra call, 96 tokens for a rambling turn."""

# Split seed is fixed here, not taken from the run seed: runs with different
# seeds share one held-out set, disjoint from every warm start's training data.
TASK_OPTIONS: dict = {"seed": 0, "digits": 3, "heldout_size": 200, "train_size": 20000, "episode": EPISODE_LIMITS}


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start: cross-entropy on the model's tokens of scripted episodes (environment tokens
    are context, never targets, exactly as in RL)."""

    steps: int = 300
    """Optimizer steps (a fixed count: the warm start is deterministic per seed). Measured with seed 0:
    after 150 steps with a 0.1 tool share the model could not yet write a call (prompted with `<`, it
    copied the operands into `<calc>..</calc>` for none of the held-out problems); after 300 steps with
    0.25 it copies them exactly for 86% and copies a given result for 56%, while greedy decoding calls
    the tool in only 23% of held-out episodes: the format is there, the habit and the precision are not."""
    batch_size: int = 64
    """Episodes per optimizer step."""
    tool_fraction: float = 0.25
    """Share of scripted episodes that call the tool; the rest answer directly with the product. Low on
    purpose: the warm start teaches the call's format, not the habit of calling (the greedy first token
    stays a digit for most problems)."""
    lr: float = 2e-3
    """AdamW peak learning rate, constant after warmup."""
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = 20
    """Linear lr warmup from 0."""
    grad_clip: float = 1.0
    num_threads: int = 1
    """torch CPU threads, pinned: bitwise-identical weights need a fixed reduction order."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction: must be in [0, 1], got {self.tool_fraction}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")


WARM_START = WarmStartConfig()
