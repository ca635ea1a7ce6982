"""`lockstep recipe prepare|train|full-train` of the shipped recipes, pinned by snapshot files.

Each snapshot (tests/recipes/snapshots/<recipe>/<action>.txt) is the exact
text the command prints: prepare on empty directories, train --dry-run (the
resolved run spec and the launch commands: compose, the SGLang server command
line and environment), full-train --dry-run on directories holding tiny
stand-ins. A change to a recipe, its layout, or the code that builds the
SGLang command line shows up as a diff here.

To refresh the snapshots on purpose, after checking that the change is the
one intended:

    LOCKSTEP_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/recipes/test_recipe_launcher.py

then review `git diff tests/recipes/snapshots` and commit it with the change.
"""
from __future__ import annotations

import difflib
import json
import os
import shutil
from pathlib import Path

import pytest

from services.cli.__main__ import _parser
from services.cli.recipe_commands import RECIPES_ROOT, RecipeRequest, run_recipe
from services.cli.recipe_layout import find_recipe
from tests.recipes.recipe_inputs import build_tiny_model, place_tiny_inputs

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE_ENV = "LOCKSTEP_UPDATE_SNAPSHOTS"
RECIPES = ("qwen3_8b_m2po", "qwen3_4b_lora_grpo", "qwen3_8b_to_1_7b_distill", "qwen3_4b_sft")
ACTIONS = {"prepare": [], "train": ["--dry-run"], "full-train": ["--dry-run"]}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def run_cli(action: str, name: str, tmp: Path, *extra: str, recipes_root: Path = RECIPES_ROOT) -> str:
    """What `lockstep recipe <action> <name> --models-dir <tmp>/models --data-dir <tmp>/data ...` prints, with
    its exit status, and `tmp` written as <tmp> so the text does not depend on where the test ran."""
    args = _parser().parse_args(["recipe", action, name, "--models-dir", str(tmp / "models"),
                                 "--data-dir", str(tmp / "data"), "--recipes-dir", str(recipes_root), *extra])
    printed: list[str] = []

    def no_client():
        raise AssertionError("a dry run opened a REST client")

    rc = run_recipe(RecipeRequest.from_args(args), emit=printed.append, client_factory=no_client)
    command = " ".join(["lockstep recipe", action, name, "--models-dir <tmp>/models --data-dir <tmp>/data", *extra])
    return f"$ {command}\n(exit {rc})\n" + "".join(printed).replace(str(tmp.resolve()), "<tmp>")


def snapshot_diff(path: Path, actual: str) -> str:
    """'' when `actual` equals the committed snapshot, else a unified diff (snapshot -> actual)."""
    expected = path.read_text() if path.is_file() else ""
    if actual == expected:
        return ""
    return "".join(difflib.unified_diff(expected.splitlines(True), actual.splitlines(True),
                                        str(path), "actual"))


def check_snapshot(path: Path, actual: str) -> None:
    if os.environ.get(UPDATE_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(actual)
        return
    if not path.is_file():
        pytest.fail(f"no snapshot {path}; create it with {UPDATE_ENV}=1 (module docstring)", pytrace=False)
    diff = snapshot_diff(path, actual)
    if diff:
        pytest.fail(f"output differs from {path} (refresh on purpose with {UPDATE_ENV}=1):\n{diff}", pytrace=False)


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("action", list(ACTIONS))
def test_recipe_commands_match_their_snapshots(name, action, tmp_path, tiny_model):
    if action == "full-train":  # prepare's checks pass, so the dry run follows
        recipe = find_recipe(name, RECIPES_ROOT)
        place_tiny_inputs(recipe, tmp_path / "models", tmp_path / "data", tiny_model)
    check_snapshot(SNAPSHOTS / name / f"{action.replace('-', '_')}.txt", run_cli(action, name, tmp_path, *ACTIONS[action]))


def test_a_changed_recipe_fails_its_snapshot(tmp_path):
    root = tmp_path / "recipes"
    shutil.copytree(RECIPES_ROOT / "qwen3_4b_lora_grpo", root / "qwen3_4b_lora_grpo")
    snapshot = SNAPSHOTS / "qwen3_4b_lora_grpo" / "train.txt"
    work = tmp_path / "work"
    assert snapshot_diff(snapshot, run_cli("train", "qwen3_4b_lora_grpo", work, "--dry-run", recipes_root=root)) == ""
    recipe_file = root / "qwen3_4b_lora_grpo" / "recipe.yaml"
    text = recipe_file.read_text()
    assert "  lr: 2.0e-5\n" in text
    recipe_file.write_text(text.replace("  lr: 2.0e-5\n", "  lr: 3.0e-5\n"))
    diff = snapshot_diff(snapshot, run_cli("train", "qwen3_4b_lora_grpo", work, "--dry-run", recipes_root=root))
    assert '-    "lr": 2e-05,' in diff and '+    "lr": 3e-05,' in diff


def test_a_changed_sglang_option_shows_in_the_launch_command(tmp_path):
    out = run_cli("train", "qwen3_4b_lora_grpo", tmp_path, "--dry-run",
                  "--set", "rollout.engine_options.server.chunked_prefill_size=8192")
    assert "--chunked-prefill-size=8192" in out and "--chunked-prefill-size=4096" not in out


def test_start_from_submits_the_checkpoint_of_a_run_instead_of_the_model(tmp_path):
    # SFT, then RL: the GRPO recipe started from the SFT run's checkpoint (recipes/qwen3_4b_sft/README.md).
    out = run_cli("show", "qwen3_4b_lora_grpo", tmp_path, "--start-from", "sft-run:500")
    spec = json.loads(out.split("## run spec (POST /v1/runs)\n")[1].split("\n## launch")[0])
    assert "model_path" not in spec and spec["start_from"] == {"run": "sft-run", "step": 500}
    assert "'--model-path=<checkpoint_of_start_from.run>'" in out


def test_the_distillation_recipe_launches_no_sglang_server(tmp_path):
    out = run_cli("train", "qwen3_8b_to_1_7b_distill", tmp_path, "--dry-run")
    assert "SGLang server: none (rollout.engine is 'torch')" in out  # true_on_policy: the torch engine
    assert '"model_path": "<tmp>/models/Qwen3-8B"' in out and '"model_path": "<tmp>/models/Qwen3-1.7B"' in out
