"""The tiny CPU distillation demo: a larger tiny teacher, trained in code for longer, distils into the demo's
warm-started student through the REST API (`teacher` in the run spec, docs/distillation.md).

- `TEACHER`: a wider, deeper tiny Qwen3 (same char tokenizer, so the vocabularies agree token for token),
  warm-started by recipes/tiny_arith/prepare.py's own supervised loop with `TEACHER_WARM_START` (on until
  its train probe reaches 90% greedy accuracy);
- the student is the demo's warm start (`recipes.tiny_arith.prepare`, about 20% accuracy);
- recipe.yaml distils on the arithmetic task's prompts with the pure reverse-KL advantage.
"""
from __future__ import annotations

import dataclasses

from recipes.tiny_arith import WarmStartConfig
from recipes.tiny_model import TinyQwen3Config

TEACHER = TinyQwen3Config(
    hidden_size=192,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=512,
    max_position_embeddings=128,
)

TEACHER_WARM_START = dataclasses.replace(WarmStartConfig(), target_accuracy=0.9, max_steps=1500)
"""The demo's warm start settings, trained on to 90% train-probe accuracy (at most 1500 steps)."""
