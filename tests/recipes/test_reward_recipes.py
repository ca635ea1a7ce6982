"""The reward recipes are valid run specs once their paths are set: the GPU judge and reward-model recipes (with
tiny stand-ins for their models and data) and recipes/tiny_judge, whose relative scorer path resolves beside it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from contract.judge_template import render_template
from recipes.tiny_model import build_model_dir
from services.cli.client import load_recipe
from services.coordinator.rewards.verdicts import check_score, read_verdict
from services.coordinator.run_spec import parse_run_spec
from tests.conftest import REPO_ROOT
from tests.coordinator.rewards.test_reward_spec import reward_model_dir


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_recipes")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(30)]
    for name in ("train.jsonl", "test.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"policy": build_model_dir(root / "policy", seed=0), "rm": reward_model_dir(root), "root": root}


def test_the_gpu_judge_recipe_is_valid_and_its_rubric_parses_a_verdict(inputs):
    spec = load_recipe(REPO_ROOT / "recipes" / "judge_gpu" / "recipe.yaml", {
        "model_path": str(inputs["policy"]), "reward.judge.model_path": str(inputs["policy"]),
        "task.options.path": str(inputs["root"] / "train.jsonl"),
        "task.options.heldout_path": str(inputs["root"] / "test.jsonl")})
    judge = parse_run_spec(json.dumps(spec).encode()).reward.judge
    rendered = render_template(judge.template, prompt="What is 2 + 2?", response="4", reference="4")
    assert "What is 2 + 2?" in rendered and "Reference answer: 4" in rendered and "{" not in rendered
    assert check_score(read_verdict("The final answer matches.\nScore: 10", judge.parser), judge.score_range) == 10
    # The score the verdict ends with, not one it quotes on the way.
    assert read_verdict("A sloppy grader would say Score: 7 here.\nScore: 3", judge.parser) == 3
    assert re.search(judge.parser.pattern, "Score: 7, I think") is None


def test_the_gpu_reward_model_recipe_is_valid(inputs):
    spec = load_recipe(REPO_ROOT / "recipes" / "reward_model_gpu" / "recipe.yaml", {
        "model_path": str(inputs["policy"]), "reward.reward_model.model_path": str(inputs["rm"]),
        "task.options.path": str(inputs["root"] / "train.jsonl"),
        "task.options.heldout_path": str(inputs["root"] / "test.jsonl")})
    parsed = parse_run_spec(json.dumps(spec).encode())
    assert parsed.reward.sources() == {"reward_model": 1.0}
    assert parsed.reward.reward_model.engine_options["dtype"] == parsed.trainer.dtype == "bfloat16"


def test_the_tiny_judge_recipe_resolves_its_reward_model_beside_it(inputs, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO_ROOT / "recipes" / "tiny_judge" / "recipe.yaml").read_text())
    (tmp_path / "runs" / "tiny_judge").mkdir(parents=True)
    (tmp_path / "runs" / "tiny_judge" / "reward_model").symlink_to(inputs["rm"])
    spec = load_recipe(recipe, {"model_path": str(inputs["policy"])})
    assert spec["reward"]["reward_model"]["model_path"] == str((tmp_path / "runs" / "tiny_judge" / "reward_model")
                                                             .resolve())
    assert parse_run_spec(json.dumps(spec).encode()).reward.kind == "reward_model"
