"""The run's `numerics` decides both sides: it configures the torch engine and the trainer, and refuses what
cannot agree bitwise (another engine, another log-prob kernel, a trainer option the mode forbids)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _spec(model_dir, numerics: str | None = "true_on_policy", *, rollout: dict | None = None,
          trainer: dict | None = None) -> dict:
    spec = {"name": "n", "model_path": str(model_dir), "steps": 1, "task": {"name": "arithmetic"},
            "rollout": rollout or {}, "trainer": trainer or {}}
    if numerics is not None:
        spec["numerics"] = numerics
    return spec


def test_true_on_policy_configures_the_engine_and_the_trainer(model_dir):
    spec = RunSpec.model_validate(_spec(model_dir, rollout={"engine_options": {"dtype": "bfloat16"}}))
    assert spec.trainer.numerics == "true_on_policy"
    assert spec.rollout.engine_options == {"dtype": "bfloat16", "numerics": "true_on_policy"}
    # What is stored is what runs: validating the dump again gives the same spec.
    assert RunSpec.model_validate(spec.model_dump()) == spec


def test_fast_is_the_default_and_leaves_the_engine_options_alone(model_dir):
    spec = RunSpec.model_validate(_spec(model_dir, None, rollout={"engine_options": {"dtype": "float32"}}))
    assert spec.numerics == "fast" and spec.trainer.numerics == "fast"
    assert spec.rollout.engine_options == {"dtype": "float32"}


@pytest.mark.parametrize(("numerics", "rollout", "trainer", "field"), [
    ("fast", {}, {"numerics": "true_on_policy"}, "trainer.numerics"),
    ("true_on_policy", {}, {"numerics": "fast"}, "trainer.numerics"),
    (None, {"engine_options": {"numerics": "true_on_policy"}}, {}, "rollout.engine_options.numerics"),
    ("true_on_policy", {"engine": "sglang"}, {}, "rollout.engine"),
    ("true_on_policy", {"engine_options": {"logprob_backend": "reference"}}, {}, "rollout.engine_options.logprob_backend"),
    ("true_on_policy", {}, {"compile_layers": True}, "trainer: compile_layers"),
    ("true_on_policy", {}, {"batching": "padded"}, "trainer: batching"),
])
def test_what_cannot_agree_bitwise_is_refused_naming_the_field(model_dir, numerics, rollout, trainer, field):
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(_spec(model_dir, numerics, rollout=rollout, trainer=trainer))
    assert field in str(exc.value), str(exc.value)


def test_repeating_the_mode_below_is_accepted(model_dir):
    spec = RunSpec.model_validate(_spec(model_dir, rollout={"engine_options": {"numerics": "true_on_policy"}},
                                        trainer={"numerics": "true_on_policy"}))
    assert spec.trainer.numerics == "true_on_policy"
