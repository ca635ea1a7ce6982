"""Tiny stand-ins for a recipe's inputs: a tiny Qwen3 model directory (and a teacher's), small JSONL sets in the
task's fields, and a small SFT dataset of chat conversations in the fields the recipe's `sft` section names."""
from __future__ import annotations

import json
from pathlib import Path

from recipes.tiny_model import build_model_dir
from services.cli.recipe_layout import Recipe, resolve_spec, sft_spec, task_fields

TRAIN_PROBLEMS = 130
"""More than the recipes' task.options.heldout_size (100), so the training split is not empty."""
EVAL_PROBLEMS = 5
SFT_EXAMPLES = 6
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
"""A chat template the character tokenizer can render (the tiny model has none of its own): an SFT dataset of
conversations needs one, as the coordinator's reader renders each turn with it."""


def problems(fields: tuple[str, ...], count: int, offset: int = 0) -> list[dict]:
    question, answer = fields
    return [{question: f"What is {i} + {i + 1}?", answer: str(2 * i + 1)} for i in range(offset, offset + count)]


def conversations(messages_field: str, count: int) -> list[dict]:
    return [{messages_field: [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{i}+{i}="},
                              {"role": "assistant", "content": str(2 * i)}]} for i in range(count)]


def copy_model(tiny_model: Path, target: Path, *, chat_template: bool) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for f in tiny_model.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    if chat_template:
        config = json.loads((target / "tokenizer_config.json").read_text())
        (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))


def place_tiny_inputs(recipe: Recipe, models_dir: Path, data_dir: Path, tiny_model: Path) -> None:
    """Put a copy of `tiny_model` (for the model and any teacher) and small JSONL files where the recipe's
    layout says they go."""
    spec = resolve_spec(recipe, models_dir=str(models_dir), data_dir=str(data_dir), overrides={})
    has_sft = any(item.checked_as == "sft" for item in recipe.layout.data)
    copy_model(tiny_model, models_dir / recipe.layout.model.dir, chat_template=has_sft)
    if recipe.layout.teacher is not None:
        copy_model(tiny_model, models_dir / recipe.layout.teacher.dir, chat_template=False)
    fields, _ = task_fields(spec)
    for i, item in enumerate(recipe.layout.data):
        path = data_dir / item.file
        path.parent.mkdir(parents=True, exist_ok=True)
        if item.checked_as == "sft":
            rows = conversations(sft_spec(spec, path).messages_field, SFT_EXAMPLES)
        else:
            rows = problems(fields, TRAIN_PROBLEMS if item.spec_field.startswith("task.") else EVAL_PROBLEMS,
                            offset=1000 * i)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_tiny_model(directory: Path) -> Path:
    return build_model_dir(directory, seed=0)
