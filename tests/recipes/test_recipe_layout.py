"""What `lockstep recipe prepare` checks and writes, and how a recipe's paths are filled in."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.cli.__main__ import main
from services.cli.recipe_commands import RECIPES_ROOT
from services.cli.recipe_layout import (
    check_jsonl,
    check_model,
    find_recipe,
    resolve_spec,
    set_existing_field,
)
from tests.recipes.recipe_inputs import build_tiny_model, place_tiny_inputs

RECIPES = ("qwen3_8b_m2po", "qwen3_4b_lora_grpo")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("name", RECIPES)
def test_prepare_creates_only_the_directories_it_names_and_fails_until_the_files_are_there(name, tmp_path, capsys,
                                                                                          tiny_model):
    argv = ["recipe", "prepare", name, "--models-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    recipe = find_recipe(name, RECIPES_ROOT)
    data_dirs = {str(Path("data") / Path(item.file).parent) for item in recipe.layout.data}
    assert tree(tmp_path) == {"models", "data", *data_dirs}  # directories only: no file written
    for d in data_dirs:
        assert str(tmp_path / d) in out.split("created directories: ")[1].splitlines()[0]
    assert out.count("FAIL") == 1 + len(recipe.layout.data) and "result: " in out
    place_tiny_inputs(recipe, tmp_path / "models", tmp_path / "data", tiny_model)
    before = tree(tmp_path)
    assert main(argv) == 0
    assert "result: ready" in capsys.readouterr().out
    assert tree(tmp_path) == before  # a second prepare writes nothing


def test_model_checks_name_what_is_wrong(tmp_path, tiny_model):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    assert all(f.ok for f in check_model(model))
    (model / "config.json").write_text("{not json")
    (model / "tokenizer.json").unlink()
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    bad = {f.path.name: f.detail for f in check_model(model) if not f.ok}
    assert bad.keys() == {"config.json", "tokenizer.json", "model.safetensors.index.json"}
    assert bad["config.json"].startswith("does not parse")
    assert bad["model.safetensors.index.json"] == "1 of 2 shards missing, first model-00002-of-00002.safetensors"
    (model / "config.json").write_text("[]")
    assert [f.detail for f in check_model(model) if f.path.name == "config.json"] == [
        "is not a JSON object with a model_type"]


@pytest.mark.parametrize(("lines", "marker", "detail"), [
    (['{"problem": "1+1?", "answer": "2"}', "[1, 2]"], "", "line 2: a JSON list, not an object"),
    (['{"problem": "1+1?"}'], "", "line 1: field 'answer' missing or not a non-empty string (has ['problem'])"),
    (['{"problem": "1+1?", "answer": 2}'], "", "line 1: field 'answer' missing or not a non-empty string"),
    (['{"problem": "1+1?", "answer": "2"}', "", "{oops"], "", "line 3: not JSON"),
    (['{"problem": "1+1?", "answer": "so 2"}'], "####", "line 1: field 'answer' does not contain answer_marker"),
    ([""], "", "no problems in it"),
])
def test_jsonl_checks_stop_at_the_first_bad_line_and_name_it(tmp_path, lines, marker, detail):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    finding = check_jsonl(path, ("problem", "answer"), marker)
    assert not finding.ok and finding.detail.startswith(detail), finding.detail


def test_jsonl_with_the_fields_passes(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "so #### 2", "extra": 1}\n\n{"problem": "2+2?", "answer": "#### 4"}\n')
    finding = check_jsonl(path, ("problem", "answer"), "####")
    assert finding.ok and finding.detail == "2 problems with 'problem', 'answer'"
    assert check_jsonl(tmp_path / "absent.jsonl", ("problem", "answer"), "").detail == "missing"


@pytest.mark.parametrize("name", RECIPES)
def test_resolved_spec_names_every_layout_path_and_applies_overrides_last(name):
    recipe = find_recipe(name, RECIPES_ROOT)
    spec = resolve_spec(recipe, models_dir="/srv/models", data_dir="/srv/data",
                        overrides={"steps": 3, "eval.every": 0})
    assert spec["model_path"] == f"/srv/models/{recipe.layout.model.dir}"
    assert spec["task"]["options"]["path"].startswith("/srv/data/")
    paths = [spec["task"]["options"]["path"], *(s["path"] for s in spec["eval"]["sets"])]
    assert paths == [f"/srv/data/{item.file}" for item in recipe.layout.data]
    assert (spec["steps"], spec["eval"]["every"]) == (3, 0)


def test_a_layout_naming_a_field_the_recipe_lacks_is_refused():
    spec = {"task": {"options": {}}, "eval": {"sets": [{"name": "a", "path": "x"}]}}
    with pytest.raises(ValueError, match="eval.sets.3.path: eval.sets has 1 entries, no \\[3\\]"):
        set_existing_field(spec, "eval.sets.3.path", "y")
    with pytest.raises(ValueError, match="task.options.path: the recipe has no field task.options.path"):
        set_existing_field(spec, "task.options.path", "y")
    set_existing_field(spec, "eval.sets.0.path", "y")
    assert spec["eval"]["sets"][0]["path"] == "y"


@pytest.mark.parametrize(("edit", "message"), [
    (("dir: Qwen3-4B", "dir: ../Qwen3-4B"), "model.dir: Value error, must be a relative path inside its directory"),
    (("file: aime-2024/aime-2024.jsonl", "file: /etc/aime.jsonl"), "data.1.file: Value error, must be a relative"),
    (("platform: rocm", "platform: tpu"), "launch.platform: String should match pattern"),
])
def test_a_layout_cannot_point_outside_its_directories(tmp_path, edit, message):
    root = tmp_path / "recipes"
    shutil.copytree(RECIPES_ROOT / "qwen3_4b_lora_grpo", root / "qwen3_4b_lora_grpo")
    layout = root / "qwen3_4b_lora_grpo" / "layout.yaml"
    assert edit[0] in layout.read_text()
    layout.write_text(layout.read_text().replace(*edit))
    with pytest.raises(ValueError, match=message.replace(".", "\\.", 0)):
        find_recipe("qwen3_4b_lora_grpo", root)


@pytest.mark.parametrize("name", ["nope", "../recipes/gsm8k", "gsm8k"])
def test_unknown_recipes_are_refused_listing_the_known_ones(name, capsys, tmp_path):
    rc = main(["recipe", "show", name, "--models-dir", str(tmp_path), "--data-dir", str(tmp_path)])
    # The message is wrapped to the terminal width, and its length depends on
    # tmp_path, so compare with whitespace runs collapsed.
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 2 and "recipes with a layout: ['qwen3_4b_lora_grpo', 'qwen3_8b_m2po']" in out


def test_a_chat_dataset_is_checked_for_its_answer_not_a_question_field():
    from services.cli.recipe_layout import task_fields

    options = {"question_field": "q", "answer_field": "a", "answer_marker": "####"}
    assert task_fields({"task": {"name": "math", "options": options}}) == (("q", "a"), "####")
    chat = {**options, "dataset": {"messages_field": "messages"}}
    assert task_fields({"task": {"name": "math", "options": chat}}) == (("a",), "####")
