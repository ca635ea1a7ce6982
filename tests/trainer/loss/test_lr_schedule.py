"""Learning-rate schedule: the pure function, its validation, and what the real Trainer applies.

Expected values are computed here from the documented formulas, not by
calling the code under test a second way.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from pydantic import ValidationError
from trainer_support import make_episodes, rollout_logprobs

from contract.trainer_run import TrainerRunConfig
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import InvalidRequest, StepRequest
from services.trainer.loss.lr_schedule import LRSchedule, lr_at, mean_token_staleness, staleness_factor
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer, parse_run_config

BASE = 3e-4


# ------------------------------------------------------------ pure function --

@pytest.mark.parametrize("base_lr", [1e-5, 3e-4, 0.1, 1.0, 7.123456789e-6])
def test_default_schedule_is_base_lr_exactly(base_lr):
    for step in (1, 2, 3, 10, 1000, 10**6):
        assert lr_at(step, base_lr, LRSchedule()) == base_lr  # ==, not approx: existing runs unchanged
    assert TrainerRunConfig().lr_schedule == LRSchedule()


def test_warmup_is_linear_from_lr_over_n_to_lr():
    sched = LRSchedule(warmup_steps=4)
    assert [lr_at(s, BASE, sched) for s in (1, 2, 3, 4)] == pytest.approx([BASE / 4, BASE / 2, 3 * BASE / 4, BASE])
    assert lr_at(4, BASE, sched) == BASE  # warmup ends on lr to the bit
    assert all(lr_at(s, BASE, sched) == BASE for s in (5, 6, 100))  # then constant


def test_linear_decay_at_known_points():
    sched = LRSchedule(warmup_steps=2, decay="linear", decay_steps=12, min_lr_ratio=0.1)
    floor = 0.1 * BASE

    def expected(step: int) -> float:  # from lr at step 2 down to floor at step 12
        return BASE - (BASE - floor) * (step - 2) / 10

    assert lr_at(1, BASE, sched) == pytest.approx(BASE / 2)
    assert lr_at(2, BASE, sched) == BASE
    for step in (3, 7, 11):
        assert lr_at(step, BASE, sched) == pytest.approx(expected(step), rel=1e-12)
    assert lr_at(7, BASE, sched) == pytest.approx((BASE + floor) / 2, rel=1e-12)  # midpoint
    assert lr_at(12, BASE, sched) == floor  # the floor exactly, and held after decay_steps
    assert lr_at(13, BASE, sched) == lr_at(10**6, BASE, sched) == floor


def test_cosine_decay_at_known_points():
    sched = LRSchedule(decay="cosine", decay_steps=8, min_lr_ratio=0.25)
    floor = 0.25 * BASE
    # No warmup: progress at step s is s / 8.
    assert lr_at(4, BASE, sched) == pytest.approx((BASE + floor) / 2, rel=1e-12)  # cos(pi/2) = 0
    assert lr_at(2, BASE, sched) == pytest.approx(floor + (BASE - floor) * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    assert lr_at(6, BASE, sched) == pytest.approx(floor + (BASE - floor) * (1 - math.sqrt(0.5)) / 2, rel=1e-12)
    assert lr_at(8, BASE, sched) == floor
    assert lr_at(9, BASE, sched) == floor


def test_zero_floor_reaches_zero_and_full_floor_is_constant():
    for decay in ("linear", "cosine"):
        assert lr_at(5, BASE, LRSchedule(decay=decay, decay_steps=5)) == 0.0
        flat = LRSchedule(warmup_steps=1, decay=decay, decay_steps=5, min_lr_ratio=1.0)
        assert all(lr_at(s, BASE, flat) == BASE for s in range(1, 10))


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_rises_through_warmup_then_never_rises_and_stays_within_bounds(decay):
    sched = LRSchedule(warmup_steps=5, decay=decay, decay_steps=40, min_lr_ratio=0.05)
    lrs = [lr_at(s, BASE, sched) for s in range(1, 60)]
    warm, rest = lrs[:5], lrs[4:]
    assert all(a < b for a, b in zip(warm, warm[1:]))
    assert all(a >= b for a, b in zip(rest, rest[1:]))
    assert all(a > b for a, b in zip(rest[:36], rest[1:36]))  # strictly down until decay_steps
    assert all(0.05 * BASE <= x <= BASE for x in rest)


def test_step_is_one_based():
    with pytest.raises(ValueError, match="step: 0, optimizer steps are 1-based"):
        lr_at(0, BASE, LRSchedule())


@pytest.mark.parametrize("tau, factor", [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (2.0, 0.5), (2.5, 0.4), (4.0, 0.25)])
def test_inverse_staleness_scaling_is_lr_over_tau_floored_at_one(tau, factor):
    assert staleness_factor(tau, "inverse") == pytest.approx(factor, rel=1e-15)
    assert staleness_factor(tau, "none") == 1.0  # a multiplication by 1.0: the rate's bits unchanged


def test_staleness_cannot_be_negative():
    with pytest.raises(ValueError, match="mean_staleness: -1.0 < 0"):
        staleness_factor(-1.0, "inverse")


def test_mean_token_staleness_averages_over_model_tokens_only():
    def sample(n_response: int, lag_sum: int, mask: list[bool] | None = None) -> TrainSample:
        return TrainSample("g/0", "g", torch.tensor([1]), torch.arange(n_response), torch.zeros(n_response), 0.0, 0.0,
                           None if mask is None else torch.tensor(mask), staleness_sum=lag_sum)

    assert mean_token_staleness([]) == 0.0
    assert mean_token_staleness([sample(3, 0), sample(2, 0)]) == 0.0
    assert mean_token_staleness([sample(3, 6), sample(1, 1)]) == pytest.approx(7 / 4)
    # An episode's 2 environment tokens are context, not trained: 4 model tokens, each 2 behind.
    assert mean_token_staleness([sample(6, 8, [True, True, False, False, True, True])]) == 2.0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(decay="linear"), "decay_steps: required when decay is 'linear'"),
        (dict(decay="cosine"), "decay_steps: required when decay is 'cosine'"),
        (dict(decay="cosine", decay_steps=5, warmup_steps=5), r"warmup_steps: 5 must be less than decay_steps \(5\)"),
        (dict(decay_steps=10), "decay_steps: 10 is set but decay is 'constant'"),
        (dict(min_lr_ratio=0.1), "min_lr_ratio: 0.1 is set but decay is 'constant'"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(decay="linear", decay_steps=0), "decay_steps"),
        (dict(decay="linear", decay_steps=4, min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(decay="step"), "decay"),
        (dict(warmup=3), "warmup"),
    ],
)
def test_validation_names_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        LRSchedule(**fields)


def test_trainer_refuses_a_bad_schedule_naming_the_field():
    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.lr_schedule: .*decay_steps: required"):
        parse_run_config(json.dumps({"lr_schedule": {"decay": "cosine"}}))
    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.lr_schedule\.min_lr_ratio"):
        parse_run_config(json.dumps({"lr_schedule": {"decay": "cosine", "decay_steps": 3, "min_lr_ratio": -1}}))


# ------------------------------------------------------------ through the Trainer --

SCHEDULE = {"warmup_steps": 2, "decay": "cosine", "decay_steps": 5, "min_lr_ratio": 0.1}
RUN_CONFIG = {"lr": 1e-2, "microbatch_tokens": 24, "lr_schedule": SCHEDULE}


def _configure(model_dir, **kwargs) -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id="run", model_path=str(model_dir), seed=11, config_json=json.dumps(RUN_CONFIG), **kwargs)
    return t


def _on_policy_step(trainer: Trainer, step: int) -> StepRequest:
    eps = make_episodes(seed=1 + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    samples = [
        TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                    torch.tensor(rollout_logprobs(trainer.run.model, e["prompt"], e["response"])), e["reward"], a)
        for e, a in zip(eps, adv)
    ]
    return StepRequest("run", step, step - 1, samples)


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.master_state_dict().items()}


def _group_lrs(trainer: Trainer) -> set[float]:
    return {g["lr"] for g in trainer.run.optimizer.param_groups}


@pytest.mark.usefixtures("restore_torch_globals")
def test_trainer_applies_and_reports_the_scheduled_lr_also_after_resume(tiny_model_dir, tmp_path):
    sched = LRSchedule(**SCHEDULE)
    expected = {s: lr_at(s, 1e-2, sched) for s in (1, 2, 3)}
    assert len(set(expected.values())) == 3  # warmup, peak, decay: a stale lr would show

    t = _configure(tiny_model_dir)
    for s in (1, 2):
        assert t.train_step(_on_policy_step(t, s)).metrics["lr"] == expected[s]
        assert _group_lrs(t) == {expected[s]}
    ckpt_dir, _ = t.save_checkpoint("run", str(tmp_path / "step_2"))
    # The checkpoint's optimizer state carries step 2's lr: what a restore would leave in place.
    saved = torch.load(ckpt_dir / "optimizer.pt", weights_only=True)
    assert {g["lr"] for g in saved["param_groups"]} == {expected[2]}

    step3 = _on_policy_step(t, 3)
    assert t.train_step(step3).metrics["lr"] == expected[3] and _group_lrs(t) == {expected[3]}
    after3 = _weights(t)

    # Resumed in a fresh trainer from step 2: step 3 applies lr_at(3), so the
    # update is bitwise the uninterrupted one.
    r = _configure(tiny_model_dir, resume_checkpoint=str(ckpt_dir))
    assert r.run.policy_version == 2 and _group_lrs(r) == {expected[2]}
    assert r.train_step(step3).metrics["lr"] == expected[3] and _group_lrs(r) == {expected[3]}
    assert all(torch.equal(after3[k], v) for k, v in _weights(r).items())

    # LoadCheckpoint into the held run (back to 2), then step 3 again: same.
    assert t.load_checkpoint("run", str(ckpt_dir)) == 2 and _group_lrs(t) == {expected[2]}
    assert t.train_step(step3).metrics["lr"] == expected[3]
    assert all(torch.equal(after3[k], v) for k, v in _weights(t).items())
    # A replay answers with the recorded lr and changes nothing.
    assert t.train_step(StepRequest("run", 3, 2, [])).metrics["lr"] == expected[3]


def _lagged(request: StepRequest, lags: list[int]) -> StepRequest:
    """The step with sample i's every model token `lags[i % len(lags)]` versions behind the trainer."""
    samples = [dataclasses.replace(s, staleness_sum=lags[i % len(lags)] * s.num_model_tokens)
               for i, s in enumerate(request.samples)]
    return dataclasses.replace(request, samples=samples)


@pytest.mark.usefixtures("restore_torch_globals")
def test_trainer_divides_the_rate_by_the_steps_mean_token_staleness(tiny_model_dir):
    base = {"lr": 1e-2, "microbatch_tokens": 24}
    scaled, plain = Trainer(num_threads=1), Trainer(num_threads=1)
    scaled.configure(run_id="run", model_path=str(tiny_model_dir), seed=11,
                     config_json=json.dumps({**base, "lr_schedule": {"staleness_scaling": "inverse"}}))
    plain.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(base))
    # Steps 1 and 2: at most one version behind keeps the rate, so the two trainers stay bitwise equal.
    for step, lags in ((1, [0]), (2, [1])):
        request = _lagged(_on_policy_step(plain, step), lags)
        assert scaled.train_step(request).metrics["lr"] == plain.train_step(request).metrics["lr"] == 1e-2
    before = _weights(plain)
    assert all(torch.equal(before[k], v) for k, v in _weights(scaled).items())

    step3 = _lagged(_on_policy_step(plain, 3), [2])  # fixed_lag K = 2 once the lag is full
    assert scaled.train_step(step3).metrics["lr"] == 1e-2 / 2 and _group_lrs(scaled) == {1e-2 / 2}
    assert plain.train_step(step3).metrics["lr"] == 1e-2
    # Same gradients and moments on both sides, so AdamW's step is proportional to the rate.
    moved = {name: torch.cat([(w[k] - before[k]).flatten() for k in before]).norm()
             for name, w in (("scaled", _weights(scaled)), ("plain", _weights(plain)))}
    assert float(moved["scaled"] / moved["plain"]) == pytest.approx(0.5, rel=1e-4)

    step4 = _lagged(_on_policy_step(plain, 4), [2, 3, 3])  # streaming: lags differ between samples
    tau = sum(s.staleness_sum for s in step4.samples) / sum(s.num_model_tokens for s in step4.samples)
    assert 2 < tau < 3
    assert scaled.train_step(step4).metrics["lr"] == pytest.approx(1e-2 / tau, rel=1e-15)
