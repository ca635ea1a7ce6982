"""The loss settings a run spec checks at submit: the log-ratio bounds."""
from __future__ import annotations

import json

import pytest

from services.common.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpecError, parse_run_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _body(model_dir, trainer: dict, **extra) -> bytes:
    return json.dumps({"name": "n", "model_path": str(model_dir), "steps": 1, "task": {"name": "arithmetic"},
                       "trainer": trainer, **extra}).encode()


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
