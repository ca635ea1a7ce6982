"""The tiny CPU demo: GRPO on 2-digit addition with a tiny Qwen3 policy.

This package holds what the demo is made of and must agree across its parts:
- `MODEL`: the tiny Qwen3 shape (recipes/tiny_model.py builds it);
- `TASK_OPTIONS`: the arithmetic task's options. recipe.yaml's `task.options`
  must be exactly these: the warm start (prepare.py) trains on the task's
  train split, so a run that drew its held-out split from other options could
  evaluate on problems the warm start was trained on (a test checks this);
- `WarmStartConfig`: the short supervised warm start (prepare.py runs it).

Why these values (measured with an in-process replica of the GRPO loop, then
through the real services; the numbers are in the commit that set them):
2-digit addition written in normal order is learnable by a 2-layer, 128-wide
model in a few hundred supervised steps, and its learning curve passes
through partial accuracy, so a warm start stopped at ~20% accuracy leaves RL
clear headroom while sampled groups already contain both correct and wrong
answers (GRPO learns nothing from a group whose rewards are all equal).
"""
from __future__ import annotations

from dataclasses import dataclass

from recipes.tiny_model import TinyQwen3Config
from recipes.tiny_moe import TinyMoeConfig

MODEL = TinyQwen3Config(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_position_embeddings=128,
)

MOE_MODEL = TinyMoeConfig(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=192,
    max_position_embeddings=128,
)
"""`make demo`'s MoE variant (`demo --moe`): Qwen3-MoE, 8 experts, top-2, each half the dense MLP's width,
so a token's active MLP width is the dense model's 384 (docs/moe.md)."""

# Split seed is fixed here, not taken from the run seed: runs with different
# seeds must share one held-out set, and it must stay disjoint from what every
# warm start trained on.
TASK_OPTIONS: dict = {"seed": 0, "digits": 2, "heldout_size": 200}


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised warm start: cross-entropy on answer + eos tokens of train problems."""

    batch_size: int = 64
    """Problems per optimizer step."""
    lr: float = 2e-3
    """AdamW peak learning rate, constant after warmup. Measured trade-off:
    at 3e-3 accuracy sits on a plateau and then jumps, at a step that varies
    by seed by hundreds of steps; at 1e-3 the curve is smooth but the model it
    leaves is fragile under RL (GRPO at lr >= 2e-4 collapses it to ~0%). At
    2e-3 every seed measured crossed the target within 320..360 steps and
    then improved under GRPO at lr 3e-4."""
    betas: tuple[float, float] = (0.9, 0.99)
    """AdamW betas."""
    warmup_steps: int = 20
    """Linear lr warmup from 0; the first Adam steps are sign-sized and would
    otherwise shake a freshly initialised model."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    target_accuracy: float = 0.2
    """Stop as soon as greedy accuracy on the train probe reaches this (held-out
    accuracy then lands around 0.15..0.25). Stopping on a measured accuracy,
    not a step count, because small transformers learn addition in sudden
    jumps whose timing varies by seed. Low on purpose: it leaves GRPO room to
    show a large gain, while 0.2 greedy still means ~55% of prompts get at
    least one correct answer among 8 samples, so most groups carry signal."""
    check_every: int = 10
    """Steps between probe evaluations."""
    probe_size: int = 256
    """Train problems in the stopping probe (never held-out ones)."""
    max_steps: int = 800
    """Hard cap, so a seed that never reaches the target still finishes in time."""
    num_threads: int = 1
    """torch CPU threads, pinned: bitwise-identical weights need a fixed reduction order."""

    def validate(self) -> None:
        for name in ("batch_size", "check_every", "probe_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_steps < 0:
            raise ValueError(f"max_steps: must be >= 0, got {self.max_steps}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0 <= self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy: must be in [0, 1], got {self.target_accuracy}")


WARM_START = WarmStartConfig()
