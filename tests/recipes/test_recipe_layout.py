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
    check_sft,
    find_recipe,
    parse_start_from,
    resolve_spec,
    set_existing_field,
)
from tests.recipes.recipe_inputs import build_tiny_model, place_tiny_inputs

RECIPES = ("qwen3_8b_m2po", "qwen3_4b_lora_grpo", "qwen3_8b_to_1_7b_distill", "qwen3_4b_sft")


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
    # Every file the run needs is named as missing: the model, the teacher if any, each JSONL.
    models = [recipe.layout.model, *([recipe.layout.teacher] if recipe.layout.teacher else [])]
    expected = [f"FAIL {tmp_path / 'models' / m.dir}: missing: a Hugging Face model directory goes here"
                for m in models]
    expected += [f"FAIL {tmp_path / 'data' / item.file}: missing" for item in recipe.layout.data]
    assert [line.strip() for line in out.splitlines() if "FAIL" in line] == expected
    assert f"result: {len(expected)} of {len(expected)} checks failed" in out
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


def spec_value(spec: dict, dotted: str) -> object:
    node: object = spec
    for part in dotted.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


@pytest.mark.parametrize("name", RECIPES)
def test_resolved_spec_names_every_layout_path_and_applies_overrides_last(name):
    recipe = find_recipe(name, RECIPES_ROOT)
    spec = resolve_spec(recipe, models_dir="/srv/models", data_dir="/srv/data",
                        overrides={"steps": 3, "eval.every": 0})
    assert spec["model_path"] == f"/srv/models/{recipe.layout.model.dir}"
    assert spec["task"]["options"]["path"].startswith("/srv/data/")
    assert [spec_value(spec, item.spec_field) for item in recipe.layout.data] == [
        f"/srv/data/{item.file}" for item in recipe.layout.data]
    if recipe.layout.teacher is not None:
        assert spec["teacher"]["model_path"] == f"/srv/models/{recipe.layout.teacher.dir}"
    assert (spec["steps"], spec["eval"]["every"]) == (3, 0)


def test_the_new_recipes_place_a_teacher_and_an_sft_dataset():
    distill, sft = find_recipe("qwen3_8b_to_1_7b_distill", RECIPES_ROOT), find_recipe("qwen3_4b_sft", RECIPES_ROOT)
    assert (distill.layout.model.dir, distill.layout.teacher.dir) == ("Qwen3-1.7B", "Qwen3-8B")
    assert [item.checked_as for item in sft.layout.data] == ["sft", "task"] and sft.layout.teacher is None


def test_start_from_replaces_the_model_path():
    recipe = find_recipe("qwen3_4b_lora_grpo", RECIPES_ROOT)
    spec = resolve_spec(recipe, models_dir="/m", data_dir="/d", overrides={}, start_from=parse_start_from("r1:40"))
    assert "model_path" not in spec and spec["start_from"] == {"run": "r1", "step": 40}
    assert parse_start_from("r1") == {"run": "r1"}
    for bad in ("", ":3", "r1:x", "r1:0", "r1:-2"):
        with pytest.raises(ValueError, match="--start-from: .* is not RUN or RUN:STEP"):
            parse_start_from(bad)


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
    assert rc == 2 and ("recipes with a layout: ['qwen3_4b_lora_grpo', 'qwen3_4b_sft', 'qwen3_8b_m2po', "
                        "'qwen3_8b_to_1_7b_distill']") in out


def test_a_chat_dataset_is_checked_for_its_answer_not_a_question_field():
    from services.cli.recipe_layout import task_fields

    options = {"question_field": "q", "answer_field": "a", "answer_marker": "####"}
    assert task_fields({"task": {"name": "math", "options": options}}) == (("q", "a"), "####")
    chat = {**options, "dataset": {"messages_field": "messages"}}
    assert task_fields({"task": {"name": "math", "options": chat}}) == (("a",), "####")


# ------------------------------------------------------------ SFT datasets --

SFT_SPEC = {"sft": {"path": "/served/x.jsonl", "messages_field": "messages", "prompt_field": "query",
                    "completion_field": "response"}}
CHAT = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}


@pytest.mark.parametrize(("content", "detail"), [
    (json.dumps(CHAT) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
     "line 2: messages[0].role: unknown role 'robot' (known: system, user, assistant)"),
    (json.dumps(CHAT) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}),
     "line 3: messages has no assistant message"),
    (json.dumps(CHAT) + "\n" + json.dumps({"messages": "hi"}), "line 2: field 'messages' missing or not a list"),
    (json.dumps({"query": "1+1=", "response": "2"}) + "\n" + json.dumps({"query": "2+2="}),
     "line 2: field 'response' missing"),
    (json.dumps({"query": "1+1=", "response": 2}), "line 1: field 'response' is int, not a string"),
    (json.dumps(CHAT) + "\n[1]", "line 2: not a JSON object"),
    ("", "holds no examples"),
])
def test_a_bad_sft_line_is_named_with_its_file_and_line(tmp_path, content, detail):
    path = tmp_path / "sft.jsonl"
    path.write_text(content + "\n")
    finding = check_sft(path, SFT_SPEC)
    assert not finding.ok and finding.path == path and finding.detail.startswith(detail), finding.detail


def test_a_non_utf8_sft_line_and_a_missing_sft_section_are_named(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_bytes((json.dumps(CHAT) + "\n").encode() + '{"messages": "caf\u00e9"}\n'.encode("latin-1"))
    assert check_sft(path, SFT_SPEC).detail.startswith("line 2: not UTF-8")
    path.write_text(json.dumps(CHAT) + "\n")
    assert check_sft(path, {}).detail == "sft: the recipe has no `sft` section, so the dataset's fields are unknown"
    assert check_sft(path, {"sft": {"batch_size": 0}}).detail.startswith("sft.batch_size: Input should be greater")
    assert check_sft(tmp_path / "absent.jsonl", SFT_SPEC).detail == "missing"


def test_sft_datasets_in_the_recipes_fields_pass(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")
    assert check_sft(path, SFT_SPEC).detail == "2 conversations in 'messages'"
    path.write_text(json.dumps({"query": "1+1=", "response": "2"}) + "\n")
    assert check_sft(path, SFT_SPEC).detail == "1 pairs in 'query' -> 'response'"


def test_prepare_names_the_bad_sft_line_and_the_missing_teacher(tmp_path, capsys, tiny_model):
    dirs = ["--models-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data")]
    recipe = find_recipe("qwen3_4b_sft", RECIPES_ROOT)
    place_tiny_inputs(recipe, tmp_path / "models", tmp_path / "data", tiny_model)
    dataset = tmp_path / "data" / recipe.layout.data[0].file
    dataset.write_text(json.dumps(CHAT) + "\n" + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    assert main(["recipe", "prepare", "qwen3_4b_sft", *dirs]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {dataset}: line 2: messages[0].role: unknown role 'bot'" in out
    assert "result: 1 of 6 checks failed" in out

    distill = find_recipe("qwen3_8b_to_1_7b_distill", RECIPES_ROOT)
    place_tiny_inputs(distill, tmp_path / "models", tmp_path / "data", tiny_model)
    teacher = tmp_path / "models" / distill.layout.teacher.dir
    (teacher / "model.safetensors").unlink()
    assert main(["recipe", "prepare", "qwen3_8b_to_1_7b_distill", *dirs]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {teacher / 'model.safetensors'}: missing: model.safetensors" in out
    assert "result: 1 of 10 checks failed" in out


@pytest.mark.parametrize(("edit", "message"), [
    ("spec_field: task.options.path\n    source: \"Hugging Face zhuzilin/dapo",
     "checked_as 'sft' goes with spec_field 'sft.path' and only with it"),
    ("dir: Qwen3-8B", "teacher.dir: 'Qwen3-1.7B' is the model's own directory"),
])
def test_a_layout_with_a_misplaced_sft_file_or_teacher_is_refused(tmp_path, edit, message):
    root = tmp_path / "recipes"
    shutil.copytree(RECIPES_ROOT / "qwen3_8b_to_1_7b_distill", root / "qwen3_8b_to_1_7b_distill")
    layout = root / "qwen3_8b_to_1_7b_distill" / "layout.yaml"
    text = layout.read_text()
    assert edit in text
    replacement = (edit.replace("source:", "checked_as: sft\n    source:") if edit.startswith("spec_field")
                   else "dir: Qwen3-1.7B")
    layout.write_text(text.replace(edit, replacement))
    with pytest.raises(ValueError, match=message.replace("'", ".").replace("(", ".").replace(")", ".")):
        find_recipe("qwen3_8b_to_1_7b_distill", root)
