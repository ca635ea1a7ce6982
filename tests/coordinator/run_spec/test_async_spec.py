"""The run spec's `async` section is checked at submit: streaming only where the engine pauses and resumes,
and a run whose rollouts lag its policy must train with an off-policy correction."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec, RunSpecError, parse_run_spec, validation_fields

CORRECTED = {"mismatch_correction": {"mode": "truncate"}}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    model = str(build_model_dir(tmp_path_factory.mktemp("m") / "model", seed=0))
    return {"name": "a", "model_path": model, "steps": 3, "task": {"name": "arithmetic"}, "eval": {"every": 0}}


def _refused(spec: dict) -> list[dict[str, str]]:
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(spec)
    return validation_fields(exc.value.errors())


def test_the_default_is_the_synchronous_loop(base):
    spec = RunSpec.model_validate(base)
    assert (spec.async_.max_staleness, spec.async_.mode) == (0, "fixed_lag")


def test_a_stored_spec_reads_back_with_its_async_section(base):
    import json

    spec = parse_run_spec(json.dumps({**base, "async": {"max_staleness": 2}, "trainer": CORRECTED}).encode())
    stored = spec.model_dump_json()
    assert json.loads(stored)["async"] == {"max_staleness": 2, "mode": "fixed_lag"}
    assert RunSpec.model_validate_json(stored).async_.max_staleness == 2


@pytest.mark.parametrize("engine", ["torch", "sglang"])
def test_streaming_is_accepted_with_either_engine(base, engine):
    # Both engines pause a Generate in flight and continue its samples (SGLang through /pause_generation).
    spec = RunSpec.model_validate({**base, "async": {"max_staleness": 1, "mode": "streaming"}, "trainer": CORRECTED,
                                   "rollout": {"engine": engine}})
    assert (spec.async_.max_staleness, spec.async_.mode, spec.rollout.engine) == (1, "streaming", engine)


@pytest.mark.parametrize("rollout, reason", [
    ({"dynamic_sampling": {"enabled": True}}, "rollout.dynamic_sampling.enabled"),
])
def test_streaming_where_it_cannot_run_is_refused_naming_the_field(base, rollout, reason):
    import json

    with pytest.raises(RunSpecError) as exc:
        parse_run_spec(json.dumps({**base, "async": {"max_staleness": 1, "mode": "streaming"},
                                   "trainer": CORRECTED, "rollout": rollout}).encode())
    assert [f["field"] for f in exc.value.fields] == ["async.mode"]
    assert reason in exc.value.fields[0]["reason"]


def test_streaming_multi_turn_episodes_is_refused_naming_the_field(base):
    # Streaming pauses a sample mid-sequence and continues it; an episode's turns interleave environment
    # steps the engine cannot pause. fixed_lag runs episodes (each trajectory at one version).
    import json

    task = {"name": "number_guess", "options": {"max_value": 99, "episode": {"max_episode_tokens": 64}}}
    with pytest.raises(RunSpecError) as exc:
        parse_run_spec(json.dumps({**base, "task": task, "async": {"max_staleness": 1, "mode": "streaming"},
                                   "trainer": CORRECTED}).encode())
    assert [f["field"] for f in exc.value.fields] == ["async.mode"]
    assert "multi-turn episodes" in exc.value.fields[0]["reason"]
    spec = parse_run_spec(json.dumps({**base, "task": task, "async": {"max_staleness": 1, "mode": "fixed_lag"},
                                      "trainer": CORRECTED}).encode())
    assert spec.async_.mode == "fixed_lag"


@pytest.mark.parametrize("async_", [{"max_staleness": -1}, {"max_staleness": 65}, {"mode": "eager"},
                                    {"max_staleness": 1, "lag": 2}])
def test_bad_values_are_refused_naming_the_field(base, async_):
    fields = _refused({**base, "async": async_, "trainer": CORRECTED})
    assert fields and all(f["field"].startswith("async") for f in fields), fields


def test_staleness_without_an_off_policy_correction_is_refused_naming_the_field(base):
    fields = _refused({**base, "async": {"max_staleness": 1}})
    assert [f["field"] for f in fields] == ["trainer.mismatch_correction.mode"]
    assert "async.max_staleness 1" in fields[0]["reason"]


@pytest.mark.parametrize("trainer", [{"mismatch_correction": {"mode": "truncate"}},
                                     {"mismatch_correction": {"mode": "mask", "level": "sequence"}},
                                     {"policy_loss": {"kind": "m2po"}}])
def test_each_off_policy_correction_is_accepted(base, trainer):
    assert RunSpec.model_validate({**base, "async": {"max_staleness": 2}, "trainer": trainer}).async_.max_staleness == 2


def test_staleness_zero_needs_no_correction(base):
    assert RunSpec.model_validate({**base, "async": {"max_staleness": 0}}).async_.max_staleness == 0


def test_mid_run_evaluation_is_refused_with_staleness(base):
    fields = _refused({**base, "async": {"max_staleness": 1}, "trainer": CORRECTED, "eval": {"every": 2}})
    assert [f["field"] for f in fields] == ["eval.every"]


@pytest.mark.parametrize("k", [0, 1])
def test_staleness_scaling_where_it_changes_nothing_is_refused_naming_the_field(base, k):
    # lr / max(1, tau) is lr while tau <= 1: a user who set it expected it to act.
    trainer = {**CORRECTED, "lr_schedule": {"staleness_scaling": "inverse"}}
    fields = _refused({**base, "async": {"max_staleness": k}, "trainer": trainer})
    assert [f["field"] for f in fields] == ["trainer.lr_schedule.staleness_scaling"]
    assert f"it is {k}" in fields[0]["reason"]


@pytest.mark.parametrize("mode", ["fixed_lag", "streaming"])
def test_staleness_scaling_is_accepted_from_staleness_two(base, mode):
    trainer = {**CORRECTED, "lr_schedule": {"staleness_scaling": "inverse"}}
    spec = RunSpec.model_validate({**base, "async": {"max_staleness": 2, "mode": mode}, "trainer": trainer})
    assert spec.trainer.lr_schedule.staleness_scaling == "inverse"
    assert RunSpec.model_validate(base).trainer.lr_schedule.staleness_scaling == "none"
