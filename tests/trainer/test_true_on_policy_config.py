"""numerics 'true_on_policy': the run setting's refusals and the step-1 gate's bitwise demand (pure logic)."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from contract.trainer_run import TrainerRunConfig
from services.trainer.parity_gate import check_parity


def _gate(logp, rollout, **kw):
    n = logp.numel()
    return check_parity(logp, rollout, sample_index=torch.arange(n) // 4, positions=torch.arange(n) % 4 + 2,
                        attention_backend="batch_invariant", logprob_backend="reference",
                        sample_ids=[f"s{i}" for i in range((n + 3) // 4)], **kw)


def _rollout(n: int = 40) -> torch.Tensor:
    return (-torch.rand(n, generator=torch.Generator().manual_seed(0)) * 4).float()


def test_numerics_defaults_to_fast_and_is_documented():
    assert TrainerRunConfig().numerics == "fast"
    assert "bitwise" in TrainerRunConfig.model_fields["numerics"].description
    assert TrainerRunConfig(numerics="true_on_policy").numerics == "true_on_policy"
    with pytest.raises(ValidationError, match="numerics"):
        TrainerRunConfig(numerics="exact")


@pytest.mark.parametrize(("update", "field", "reason"), [
    ({"compile_layers": True}, "compile_layers", "torch.compile fuses"),
    ({"attention": {"backend": "reference"}}, "attention.backend", "conflicts with numerics 'true_on_policy'"),
    ({"batching": "padded"}, "batching", "bits depend on the batch"),
])
def test_true_on_policy_refuses_what_would_change_its_bits(update, field, reason):
    TrainerRunConfig.model_validate({**update, "numerics": "fast"})  # allowed in fast mode
    with pytest.raises(ValidationError) as exc:
        TrainerRunConfig.model_validate({**update, "numerics": "true_on_policy"})
    assert f"{field}:" in str(exc.value) and reason in str(exc.value)


def test_true_on_policy_accepts_the_batch_invariant_backend_by_name():
    cfg = TrainerRunConfig.model_validate({"numerics": "true_on_policy", "attention": {"backend": "batch_invariant"}})
    assert cfg.attention.backend == "batch_invariant"


def test_attention_policy_is_forced_in_true_on_policy_only():
    from services.trainer.run_setup import attention_policy

    assert attention_policy(TrainerRunConfig()).backend is None
    forced = attention_policy(TrainerRunConfig(numerics="true_on_policy", attention={"require_deterministic": True}))
    assert forced.backend == "batch_invariant" and forced.require_deterministic is True


def test_coordinator_run_spec_refuses_the_same_way(tmp_path):
    from recipes.tiny_model import build_model_dir
    from services.coordinator.run_spec import RunSpec

    # The run's numerics sets the trainer's; the trainer's own refusals then surface at submit.
    spec = {"name": "t", "model_path": str(build_model_dir(tmp_path / "m", seed=0)), "steps": 1,
            "task": {"name": "arithmetic"}, "numerics": "true_on_policy", "trainer": {}}
    assert RunSpec.model_validate(spec).trainer.numerics == "true_on_policy"
    spec["trainer"]["compile_layers"] = True
    with pytest.raises(ValidationError, match="trainer: compile_layers: true is refused"):
        RunSpec.model_validate(spec)
    spec["trainer"] = {"numerics": "true_on_policy", "compile_layers": True}
    with pytest.raises(ValidationError, match="trainer\n.*compile_layers: true is refused"):
        RunSpec.model_validate(spec)


def test_exact_equality_passes_the_true_on_policy_gate():
    r = _rollout()
    v = _gate(r.clone(), r, numerics="true_on_policy")
    assert v.passed, v.message()
    assert "numerics: true_on_policy (demands bitwise equality" in v.message()


def test_one_token_one_ulp_off_fails_naming_it_and_the_demand():
    r = _rollout()
    logp = r.clone()
    logp[13] = torch.nextafter(r[13], torch.tensor(0.0))  # one float32 ulp
    fast = _gate(logp, r)
    assert fast.passed  # far inside every threshold: only the bitwise demand catches it
    v = _gate(logp, r, numerics="true_on_policy")
    assert not v.passed
    (failure,) = v.failures
    assert "numerics 'true_on_policy' demands bitwise equality" in failure
    assert "1 of 40 response tokens differ" in failure
    # Token 13: sample 13 // 4 = 3 (id s3), position 13 % 4 + 2 = 3, both values in full.
    assert f"worst: sample 3 (s3) position 3: logp={float(logp[13])!r} rollout_logp={float(r[13])!r}" in failure
    assert "FAILED" in v.message()


def test_nan_fails_the_bitwise_demand():
    r = _rollout()
    logp = r.clone()
    logp[5] = float("nan")
    v = _gate(logp, r, numerics="true_on_policy")
    assert not v.passed and "1 of 40 response tokens differ" in v.failures[0]


def test_unknown_numerics_is_refused_by_the_gate():
    r = _rollout()
    with pytest.raises(ValueError, match="numerics"):
        _gate(r, r, numerics="exact")
