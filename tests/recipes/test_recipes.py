"""Recipe loading: dotted --set overrides, and the shipped recipes are valid run specs."""
from __future__ import annotations

import json

import pytest

from services.cli.client import apply_overrides, load_recipe
from services.coordinator.run_spec import parse_run_spec
from tests.conftest import REPO_ROOT


def test_dotted_overrides_set_nested_fields_and_create_missing_mappings():
    spec = {"steps": 10, "task": {"name": "math", "options": {"path": "a"}}}
    apply_overrides(spec, {"steps": 3, "task.options.path": "b", "trainer.lr_schedule.warmup_steps": 5})
    assert spec == {"steps": 3, "task": {"name": "math", "options": {"path": "b"}},
                    "trainer": {"lr_schedule": {"warmup_steps": 5}}}


@pytest.mark.parametrize("key, message", [
    ("steps.value", "steps is 10, not a mapping"),
    ("task..path", "empty field name"),
])
def test_overrides_through_a_non_mapping_or_empty_name_are_refused(key, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides({"steps": 10, "task": {}}, {key: 1})


def test_gsm8k_recipe_is_a_valid_spec_once_its_paths_are_set(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(30)]
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = load_recipe(REPO_ROOT / "recipes" / "gsm8k" / "recipe.yaml", {
        "model_path": str(model), "task.options.path": str(tmp_path / "train.jsonl"),
        "task.options.heldout_path": str(tmp_path / "test.jsonl"),
    })
    parsed = parse_run_spec(json.dumps(spec).encode())  # as POST /v1/runs validates it: strict
    assert parsed.task.name == "math" and parsed.trainer.lr_schedule.decay == "cosine"
    assert parsed.rollout.engine_options["server"]["dtype"] == parsed.trainer.dtype
    # The template asks for the boxed answer and keeps the question.
    from services.coordinator.tasks import build_task
    task = build_task(parsed.task.name, parsed.task.options)
    try:
        first = task.split("train")[0]
        assert first.prompt.startswith("Question: What is 0 + 0?") and "\\boxed{}" in first.prompt
        assert first.answer == "0"
    finally:
        task.close()


def test_exponent_without_a_dot_is_a_number_in_a_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: {lr: 1e-5, eps: 2E-8, weight_decay: 1.5e-2}\nname: '1e5'\nsteps: 3\n")
    spec = load_recipe(recipe)
    assert spec["trainer"] == {"lr": 1e-5, "eps": 2e-8, "weight_decay": 1.5e-2}
    assert spec["name"] == "1e5" and spec["steps"] == 3  # quoted stays a string, ints stay ints


@pytest.mark.parametrize("name", ["qwen3_8b_m2po", "qwen3_4b_lora_grpo"])
def test_launcher_recipes_are_valid_specs_once_prepare_passes(name, tmp_path):
    """The resolved spec of each launcher recipe validates strictly, as POST /v1/runs validates it, with its
    settings intact (LoRA, M2PO, eval sets, SGLang server options)."""
    from services.cli.recipe_commands import RECIPES_ROOT
    from services.cli.recipe_layout import check_layout, find_recipe, resolve_spec
    from tests.recipes.recipe_inputs import build_tiny_model, place_tiny_inputs

    recipe = find_recipe(name, RECIPES_ROOT)
    place_tiny_inputs(recipe, tmp_path / "models", tmp_path / "data", build_tiny_model(tmp_path / "tiny"))
    spec = resolve_spec(recipe, models_dir=str(tmp_path / "models"), data_dir=str(tmp_path / "data"), overrides={})
    assert all(f.ok for f in check_layout(recipe, spec, models_dir=tmp_path / "models", data_dir=tmp_path / "data"))
    parsed = parse_run_spec(json.dumps(spec).encode())
    assert parsed.rollout.engine == "sglang" and parsed.trainer.dtype == "bfloat16"
    assert parsed.rollout.engine_options["server"]["dtype"] == parsed.trainer.dtype
    assert [s.name for s in parsed.eval.sets] == {
        "qwen3_8b_m2po": ["math500", "amc", "aime24", "minerva"], "qwen3_4b_lora_grpo": ["aime24"]}[name]
    if name == "qwen3_8b_m2po":
        assert parsed.trainer.policy_loss.kind == "m2po" and parsed.eval.k == 4
        # Asynchronous, as the source: fixed_lag (reproducible) at AReaL's lowest recommended staleness.
        assert (parsed.async_.max_staleness, parsed.async_.mode, parsed.eval.every) == (2, "fixed_lag", 0)
        assert parsed.trainer.lora is None  # full fine-tune
    else:
        lora = parsed.trainer.lora
        assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (64, 32.0, 0.0, "all-linear")
        assert (parsed.rollout.prompts_per_step, parsed.rollout.samples_per_prompt) == (8, 8)
        assert parsed.rollout.sampling.max_new_tokens == 8192 and parsed.trainer.lr == 2e-5
        server = parsed.rollout.engine_options["server"]
        assert (server["mem_fraction_static"], server["chunked_prefill_size"]) == (0.4, 4096)
        assert server["max_lora_rank"] == lora.rank  # SGLang serves the adapter the trainer syncs


def test_relative_teacher_and_sft_paths_resolve_against_the_recipe(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "t").mkdir()
    (tmp_path / "x.jsonl").write_text("{}\n")
    (tmp_path / "r.yaml").write_text("name: a\nmodel_path: m\nteacher: {model_path: t}\nsft: {path: x.jsonl}\n")
    spec = load_recipe(tmp_path / "r.yaml")
    assert spec["model_path"] == str(tmp_path / "m") and spec["teacher"]["model_path"] == str(tmp_path / "t")
    assert spec["sft"]["path"] == str(tmp_path / "x.jsonl")
    (tmp_path / "r2.yaml").write_text("name: a\nmodel_path: m\nteacher: {model_path: absent}\n")
    assert load_recipe(tmp_path / "r2.yaml")["teacher"]["model_path"] == "absent"  # left for the server to refuse


def test_the_distillation_and_sft_recipes_are_valid_specs_once_their_paths_are_set(tmp_path):
    from recipes.tiny_arith_sft.prepare import prepare
    from recipes.tiny_model import TinyQwen3Config, build_model_dir

    inputs = prepare(tmp_path / "sft", seed=0)
    sft = parse_run_spec(json.dumps(load_recipe(REPO_ROOT / "recipes" / "tiny_arith_sft" / "recipe.yaml", {
        "model_path": inputs["model_dir"], "sft.path": inputs["dataset"]})).encode())
    assert sft.kind == "sft" and sft.trainer.objective == "sft" and sft.trainer.lr_schedule.warmup_steps == 20
    teacher = build_model_dir(tmp_path / "teacher", TinyQwen3Config(hidden_size=64, num_hidden_layers=1), seed=1)
    distill = parse_run_spec(json.dumps(load_recipe(REPO_ROOT / "recipes" / "tiny_distill" / "recipe.yaml", {
        "model_path": inputs["model_dir"], "teacher.model_path": str(teacher)})).encode())
    assert distill.trainer.teacher == distill.teacher and distill.teacher.reward_weight == 0.0


@pytest.mark.parametrize("name", ["qwen3_8b_to_1_7b_distill", "qwen3_4b_sft"])
def test_the_distillation_and_sft_gpu_recipes_are_valid_specs_once_prepare_passes(name, tmp_path):
    """The teacher and SFT recipes resolve to specs POST /v1/runs accepts (the teacher's vocabulary compared,
    the SFT dataset read and tokenized through the chat template), with their settings intact."""
    from services.cli.recipe_commands import RECIPES_ROOT
    from services.cli.recipe_layout import check_layout, find_recipe, resolve_spec
    from tests.recipes.recipe_inputs import SFT_EXAMPLES, build_tiny_model, place_tiny_inputs

    recipe = find_recipe(name, RECIPES_ROOT)
    models, data = tmp_path / "models", tmp_path / "data"
    place_tiny_inputs(recipe, models, data, build_tiny_model(tmp_path / "tiny"))
    spec = resolve_spec(recipe, models_dir=str(models), data_dir=str(data), overrides={})
    assert all(f.ok for f in check_layout(recipe, spec, models_dir=models, data_dir=data))
    parsed = parse_run_spec(json.dumps(spec).encode())
    assert parsed.trainer.dtype == "bfloat16"
    if name == "qwen3_8b_to_1_7b_distill":
        assert parsed.kind == "rl" and parsed.numerics == "true_on_policy" and parsed.rollout.engine == "torch"
        assert parsed.rollout.engine_options["numerics"] == "true_on_policy"
        assert parsed.rollout.engine_options["dtype"] == parsed.trainer.dtype
        assert parsed.teacher.model_path == str(models / "Qwen3-8B") and parsed.trainer.teacher == parsed.teacher
        assert (parsed.teacher.kl_weight, parsed.teacher.reward_weight, parsed.teacher.discount) == (1.0, 0.0, 0.0)
        assert (parsed.rollout.prompts_per_step, parsed.rollout.samples_per_prompt) == (64, 4)
        assert parsed.trainer.kl_coef == 0.0 and [s.name for s in parsed.eval.sets] == ["aime24"]
    else:
        assert parsed.kind == "sft" and parsed.trainer.objective == "sft" and parsed.teacher is None
        assert parsed.sft.path == str(data / "openhermes-2.5" / "openhermes-2.5.jsonl")
        assert (parsed.sft.messages_field, parsed.sft.batch_size, parsed.sft.max_sequence_tokens) == (
            "messages", 128, 4096)
        assert parsed.steps == -(-3 * 100_000 // parsed.sft.batch_size)  # 3 epochs of the README's 100,000
        from services.coordinator.sft.dataset import read_sft_dataset
        examples = read_sft_dataset(parsed.sft, parsed.model_path)
        assert len(examples) == SFT_EXAMPLES and all(e.loss_mask is None and e.response_ids for e in examples)
