"""Tiny stand-ins for a recipe's inputs: a tiny Qwen3 model directory and small JSONL sets in the task's fields."""
from __future__ import annotations

import json
from pathlib import Path

from recipes.tiny_model import build_model_dir
from services.cli.recipe_layout import Recipe, resolve_spec, task_fields

TRAIN_PROBLEMS = 130
"""More than the recipes' task.options.heldout_size (100), so the training split is not empty."""
EVAL_PROBLEMS = 5


def problems(fields: tuple[str, ...], count: int, offset: int = 0) -> list[dict]:
    question, answer = fields
    return [{question: f"What is {i} + {i + 1}?", answer: str(2 * i + 1)} for i in range(offset, offset + count)]


def place_tiny_inputs(recipe: Recipe, models_dir: Path, data_dir: Path, tiny_model: Path) -> None:
    """Put a copy of `tiny_model` and small JSONL files where the recipe's layout says they go."""
    target = models_dir / recipe.layout.model.dir
    target.mkdir(parents=True, exist_ok=True)
    for f in tiny_model.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    fields, _ = task_fields(resolve_spec(recipe, models_dir=str(models_dir), data_dir=str(data_dir), overrides={}))
    for i, item in enumerate(recipe.layout.data):
        path = data_dir / item.file
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = problems(fields, TRAIN_PROBLEMS if item.spec_field.startswith("task.") else EVAL_PROBLEMS,
                        offset=1000 * i)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_tiny_model(directory: Path) -> Path:
    return build_model_dir(directory, seed=0)
