"""The tiny CPU reward-model demo: the demo's warm-started policy learns arithmetic from a reward model's
score alone (reward.kind reward_model, docs/rewards.md).

- The reward model is built and trained in code (reward_model.py): a Qwen3ForSequenceClassification with one
  scalar head whose backbone starts from the policy's warm start (as real reward models start from an SFT
  model), trained supervised on labelled correct and incorrect answers to the task's train problems, half of
  the incorrect ones sampled from the policy itself;
- the exact rule never reaches the policy: it only labels the reward model's training data and scores the
  held-out evaluation, and demo.py prints how often the reward model and the rule agree.
"""
from __future__ import annotations

from dataclasses import dataclass

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}<|eos|>{% endif %}"
                 "{% endfor %}")
"""The reward model's chat template: the prompt, then the response and an eos, whose position the scalar head
reads. A reward model scores the chat its template renders (services/rollout/scorer/reward_model.py)."""


@dataclass(frozen=True)
class RewardModelTraining:
    """Supervised training of the reward model on (problem, answer, correct?) examples."""

    steps: int = 750
    """Optimizer steps."""
    batch_size: int = 256
    """Examples per step: a correct and a wrong answer to each of batch_size / 2 problems."""
    policy_fraction: float = 0.5
    """Share of the wrong answers drawn from the policy's own sampled mistakes (the rest are the right answer
    with one digit or the length changed). Only hand-made ones: the model scored most of the policy's real
    mistakes above zero. Only the policy's: it never saw the mistakes a policy makes once it changes (answers
    cut short, a wrong carry), and RL found those within 15 steps."""
    policy_samples: int = 8
    """Answers sampled from the policy per train problem, before training (a GRPO group's worth)."""
    sample_temperature: float = 1.0
    """Sampling temperature of those answers: the recipe's rollout temperature."""
    sample_max_new_tokens: int = 5
    """Token cap of a sampled answer: the recipe's max_new_tokens."""
    sample_batch_prompts: int = 256
    """Prompts sampled together (times policy_samples rows per forward)."""
    extra_layers: int = 2
    """Decoder layers added on the policy's backbone (their output projections zeroed, so the model starts as
    the backbone): where the head compares each answer digit with what the layers below predicted for it."""
    lm_weight: float = 1.0
    """Weight of the next-token loss on the correct answers, read from the backbone's last layer through the
    policy's own head (used in training only, not saved): it keeps teaching the backbone to add, which a single
    label per example would teach slowly."""
    bce_weight: float = 0.5
    """Weight of the per-example logistic loss beside the pairwise (Bradley-Terry) one: it keeps score 0 the
    boundary between right and wrong, so the agreement with the rule can be read off the sign."""
    lr: float = 1e-3
    warmup_steps: int = 20
    grad_clip: float = 1.0
    num_threads: int = 2
    """torch intra-op threads (pinned: the thread count is part of what makes the result bitwise)."""
    probe_size: int = 400
    """Train problems set aside before training (never drawn for it): the agreement is measured on them."""
    report_every: int = 100
    """Steps between progress lines on stderr (loss, probe agreement)."""


TRAINING = RewardModelTraining()
