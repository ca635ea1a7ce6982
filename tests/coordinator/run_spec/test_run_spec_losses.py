"""The loss settings a run spec resolves at submit: GSPO's aggregation default and the log-ratio bounds."""
from __future__ import annotations

import json

import pytest

from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec, RunSpecError, parse_run_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _body(model_dir, trainer: dict, **extra) -> bytes:
    return json.dumps({"name": "n", "model_path": str(model_dir), "steps": 1, "task": {"name": "arithmetic"},
                       "trainer": trainer, **extra}).encode()


def test_gspo_aggregates_per_sequence_unless_the_spec_says_otherwise(model_dir):
    spec = parse_run_spec(_body(model_dir, {"policy_loss": {"kind": "gspo"}}))
    assert spec.trainer.loss_agg == "seq_mean_token_mean"
    # What is stored and sent to the trainer names it, and reads back the same (numerics' re-validation too).
    assert json.loads(spec.trainer.model_dump_json())["loss_agg"] == "seq_mean_token_mean"
    assert RunSpec.model_validate_json(spec.model_dump_json()) == spec
    tight = parse_run_spec(_body(model_dir, {"policy_loss": {"kind": "gspo"}}, numerics="true_on_policy"))
    assert tight.trainer.loss_agg == "seq_mean_token_mean"
    # A spec that asks for the length-weighted token mean gets it; other kinds keep token_mean.
    asked = parse_run_spec(_body(model_dir, {"policy_loss": {"kind": "gspo"}, "loss_agg": "token_mean"}))
    assert asked.trainer.loss_agg == "token_mean"
    assert parse_run_spec(_body(model_dir, {})).trainer.loss_agg == "token_mean"


@pytest.mark.parametrize("trainer, reason", [
    ({"policy_loss": {"log_ratio_bound": 0.1}}, "policy_loss.log_ratio_bound: 0.1 lies inside the clip range"),
    ({"policy_loss": {"log_ratio_bound": 41.0}}, "less than or equal to 40"),
    ({"policy_loss": {"kind": "gspo", "gspo_log_ratio_bound": 2e-4}}, "gspo_log_ratio_bound: 0.0002 lies inside"),
    ({"policy_loss": {"gspo_log_ratio_bound": 5.0}}, "gspo_log_ratio_bound: only used by kind 'gspo'"),
    ({"mismatch_correction": {"mode": "truncate", "upper": 1e9}}, "policy_loss.log_ratio_bound: 20.0 must exceed"),
])
def test_bounds_that_would_change_a_decision_are_refused_naming_the_field(model_dir, trainer, reason):
    with pytest.raises(RunSpecError) as exc:
        parse_run_spec(_body(model_dir, trainer))
    text = "; ".join(f"{f['field']}: {f['reason']}" for f in exc.value.fields)
    assert text.startswith("trainer") and reason in text, text
