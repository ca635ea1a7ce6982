"""The code demo's parts: its problems, the split its warm start and its run share, the recipe's options, and
that the sandbox (the only reward) passes the expression and fails the literal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from recipes.tiny_code import HELDOUT_SIZE, MODEL, TASK_OPTIONS, WARM_START, problems
from recipes.tiny_code.prepare import splits, write_problems
from services.common.sandbox import Outcome, SandboxSettings, SandboxUnavailable
from services.common.sandbox.bwrap import probe
from services.coordinator.tasks.code import CodeConfig, CodeTask
from tests.conftest import require

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny_code" / "recipe.yaml"


def test_problems_are_unique_and_a_literal_never_passes_the_hidden_pair():
    rows = problems()
    assert len(rows) == 243 and len({r["task_id"] for r in rows}) == 243
    for row in rows:
        shown, hidden = [line.split("==")[1].strip() for line in row["test"].splitlines()[1:]]
        assert shown == row["literal"] and hidden != row["literal"]
        assert row["prompt"].endswith("\nf=lambda a,b:") and row["expression"] in ("a+b", "a-b", "a*b")


def test_the_warm_start_and_the_run_share_one_split(tmp_path):
    path = write_problems(tmp_path)
    split = splits(path)
    assert len(split["heldout"]) == HELDOUT_SIZE and len(split["train"]) == 243 - HELDOUT_SIZE
    assert not {r["task_id"] for r in split["heldout"]} & {r["task_id"] for r in split["train"]}
    recipe = yaml.safe_load(RECIPE.read_text())
    assert recipe["task"]["name"] == "code"
    assert {k: v for k, v in recipe["task"]["options"].items() if k != "path"} == TASK_OPTIONS
    assert recipe["eval"]["heldout_size"] == HELDOUT_SIZE
    # The longest intended response and its eos fit the sampling budget.
    assert recipe["rollout"]["sampling"]["max_new_tokens"] >= max(len(r["literal"]) for r in problems()) + 1
    WARM_START.validate()


def test_only_execution_decides_and_the_expression_is_what_passes(tmp_path):
    try:
        probe(SandboxSettings())
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")
    path = write_problems(tmp_path)
    task = CodeTask(CodeConfig.model_validate({**TASK_OPTIONS, "path": str(path)}, strict=False))
    try:
        chosen = task.split("heldout")[:8]
        rows = {r["task_id"]: r for r in problems()}
        items = [(p, rows[p.problem_id][form] + "<|eos|>") for p in chosen for form in ("expression", "literal")]
        results = task.run(items)
    finally:
        task.close()
    assert [r.outcome for r in results] == [Outcome.PASSED, Outcome.FAILED] * len(chosen), \
        [(r.outcome.value, r.detail, r.output_tail[-200:]) for r in results]
    assert all((r.passed, r.total) == (1, 2) for r in results[1::2])  # the literal passes the shown pair only


def test_the_recipe_is_a_valid_spec_once_its_paths_exist(tmp_path):
    try:
        probe(SandboxSettings())
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")
    from recipes.tiny_code.demo import spec_for
    from recipes.tiny_model import build_model_dir
    from services.coordinator.run_spec import RunSpec

    model = build_model_dir(tmp_path / "m", MODEL, seed=0)
    spec = spec_for(RECIPE, {}, model, str(write_problems(tmp_path)))
    RunSpec.model_validate(spec)
    assert json.loads(json.dumps(spec))["task"]["options"]["path"].endswith("problems.jsonl")
    with pytest.raises(ValueError, match="heldout_size"):
        RunSpec.model_validate({**spec, "task": {**spec["task"], "options": {
            **spec["task"]["options"], "heldout_size": 243}}})


def test_the_humaneval_recipe_is_a_valid_spec_once_its_model_is_set(tmp_path):
    try:
        probe(SandboxSettings())
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")
    from services.cli.client import load_recipe
    from services.coordinator.run_spec import parse_run_spec

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = load_recipe(REPO / "recipes" / "humaneval" / "recipe.yaml", {"model_path": str(model)})
    parsed = parse_run_spec(json.dumps(spec).encode())  # as POST /v1/runs validates it: strict
    assert parsed.task.name == "code" and parsed.task.options["path"] == ""
    assert parsed.eval.k == 4 and parsed.rollout.engine_options["server"]["dtype"] == parsed.trainer.dtype
