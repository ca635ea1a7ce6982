"""Mismatch correction: the weights by hand, the gradient it gives, and through the real Trainer."""
from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from trainer_support import make_episodes, rollout_logprobs

from contract.trainer_settings import DEFAULT_LOG_RATIO_BOUND
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.loss.mismatch_correction import MismatchCorrection
from services.trainer.loss.mismatch_correction import correction_weights as weights_with_bound
from services.trainer.loss.policy_loss import ppo_clip_token_loss
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer

D = torch.tensor([0.0, math.log(3.0), math.log(0.25), math.log(1.5), math.log(0.8)])  # log(pi_train / pi_rollout)
SEQ = torch.tensor([0, 0, 1, 1, 2])


def correction_weights(log_ratio, sample_index, config):
    """The weights at the default log-ratio bound (20), which the cases below never come near."""
    return weights_with_bound(log_ratio, sample_index, config, log_ratio_bound=20.0)


def test_none_changes_nothing():
    w = correction_weights(D, SEQ, MismatchCorrection())
    assert torch.equal(w.weights, torch.ones(5)) and not w.affected.any()


def test_token_truncate_caps_at_upper():
    w = correction_weights(D, SEQ, MismatchCorrection(mode="truncate", upper=2.0))
    assert torch.allclose(w.weights, torch.tensor([1.0, 2.0, 0.25, 1.5, 0.8]))
    assert w.affected.tolist() == [False, True, False, False, False]


def test_token_mask_zeroes_outside_the_band():
    w = correction_weights(D, SEQ, MismatchCorrection(mode="mask", upper=2.0))  # lower defaults to 1/2
    assert torch.allclose(w.weights, torch.tensor([1.0, 0.0, 0.0, 1.5, 0.8]))
    assert w.affected.tolist() == [False, True, True, False, False]
    w = correction_weights(D, SEQ, MismatchCorrection(mode="mask", upper=2.0, lower=0.2))
    assert w.affected.tolist() == [False, True, False, False, False]


def test_sequence_levels_share_one_weight_per_sequence():
    prod = correction_weights(D, SEQ, MismatchCorrection(mode="truncate", level="sequence", upper=10.0))
    assert torch.allclose(prod.weights, torch.tensor([3.0, 3.0, 0.375, 0.375, 0.8]))
    geo = correction_weights(D, SEQ, MismatchCorrection(mode="mask", level="geometric", upper=1.6))
    # Geometric means: sqrt(3) = 1.73 > 1.6 and sqrt(0.375) = 0.61 < 1/1.6 are masked; 0.8 is kept.
    assert geo.affected.tolist() == [True, True, True, True, False]
    assert torch.allclose(geo.weights, torch.tensor([0.0, 0.0, 0.0, 0.0, 0.8]))
    # Non-adjacent tokens of one sequence are still one sequence.
    mixed = correction_weights(D[[0, 2, 1, 3, 4]], SEQ[[0, 2, 1, 3, 4]],
                               MismatchCorrection(mode="truncate", level="sequence", upper=10.0))
    assert torch.allclose(mixed.weights, torch.tensor([3.0, 0.375, 3.0, 0.375, 0.8]))


def test_decoupled_loss_gradient_is_the_weighted_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    rollout = torch.tensor([-1.5, -1.0, -0.5])
    adv = torch.tensor([1.0, -1.0, 0.5])
    w = correction_weights(logp.detach() - rollout, torch.arange(3), MismatchCorrection(mode="truncate", upper=1.5))
    token = ppo_clip_token_loss(logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2,
                                log_ratio_bound=DEFAULT_LOG_RATIO_BOUND)
    loss, clipped = token.loss, token.clipped
    (loss * w.weights).sum().backward()
    # ratio against itself is 1: nothing clipped, d/dlogp = -A * w, with w = min(exp(d), 1.5).
    expected_w = torch.clamp(torch.exp(logp.detach() - rollout), max=1.5)
    assert not clipped.any()
    assert torch.allclose(logp.grad, -adv * expected_w)


@pytest.mark.parametrize("fields, message", [
    ({"mode": "truncate", "upper": 1.0}, "upper"),
    ({"mode": "truncate", "lower": 0.5}, "lower: only used by mode 'mask'"),
    ({"mode": "mask", "lower": 1.5}, "lower"),
    ({"level": "sequence"}, "mode: 'none' ignores level and upper"),
    ({"mode": "clip"}, "mode"),
])
def test_bad_config_names_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        MismatchCorrection(**fields)


def _step_with_mismatch(trainer: Trainer, shift: float) -> StepRequest:
    """Step 1 as a rollout whose log-probs are off by +shift on every other token."""
    eps = make_episodes(seed=4)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    samples = []
    for e, a in zip(eps, adv):
        lp = torch.tensor(rollout_logprobs(trainer.run.model, e["prompt"], e["response"]))
        lp[::2] += shift
        samples.append(TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]),
                                   torch.tensor(e["response"]), lp, e["reward"], a))
    return StepRequest(trainer.run.run_id, 1, 0, samples)


@pytest.mark.usefixtures("restore_torch_globals")
def test_trainer_applies_and_reports_the_correction(tiny_model_dir):
    results = {}
    for mode in ("none", "truncate", "mask"):
        t = Trainer(num_threads=1)
        correction = {"mode": mode} if mode != "none" else {}
        # The parity gate would (rightly) refuse this mismatch at step 1; its bounds are opened for the test.
        t.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps({
            "lr": 1e-2, "mismatch_correction": correction,
            "parity_gate": {"iw_mean_tolerance": 10.0, "iw_max": 100.0, "logprob_abs_diff_mean": 10.0}}))
        out = t.train_step(_step_with_mismatch(t, shift=-1.0))  # rollout less likely: w = e on those tokens
        results[mode] = (out.metrics, {k: v.clone() for k, v in t.master_state_dict().items()})
    m_none, m_trunc, m_mask = (results[k][0] for k in ("none", "truncate", "mask"))
    assert m_none["is_weight_mean"] == 1.0 and m_none["is_affected_fraction"] == 0.0
    assert m_none["clip_fraction"] > 0  # without correction the PPO clip acts on the mismatch
    # Every shifted token has w = e > 2: truncated to 2 / masked to 0; the others keep w = 1.
    n = m_trunc["tokens_response"]
    shifted = m_trunc["is_affected_fraction"] * n
    assert shifted > 0 and m_mask["is_affected_fraction"] == m_trunc["is_affected_fraction"]
    assert m_trunc["is_weight_mean"] == pytest.approx((2.0 * shifted + (n - shifted)) / n, rel=1e-5)
    assert m_mask["is_weight_mean"] == pytest.approx((n - shifted) / n, rel=1e-5)
    assert m_trunc["clip_fraction"] == 0 and m_mask["clip_fraction"] == 0  # decoupled ratio is 1
    # The mismatch statistics are measured the same way whatever the correction.
    assert m_none["iw_max"] == m_trunc["iw_max"] == m_mask["iw_max"]
    w_none, w_trunc, w_mask = (results[k][1] for k in ("none", "truncate", "mask"))
    assert any(not torch.equal(w_trunc[k], w_mask[k]) for k in w_trunc)
    assert any(not torch.equal(w_none[k], w_trunc[k]) for k in w_none)


def test_log_weights_beyond_the_bound_are_clamped_before_exp_and_reported():
    # log w = 25 and -25 per token: clamped to +-20 (truncated to upper, and e^-20, both finite); a
    # sequence of two tokens of 15 sums to 30, clamped too; 0.1 is untouched.
    d = torch.tensor([25.0, -25.0, 15.0, 15.0, 0.1])
    seq = torch.tensor([0, 1, 2, 2, 3])
    tok = weights_with_bound(d, seq, MismatchCorrection(mode="truncate", upper=2.0), log_ratio_bound=20.0)
    assert tok.clamped.tolist() == [True, True, False, False, False]
    assert tok.weights.tolist() == pytest.approx([2.0, math.exp(-20), 2.0, 2.0, math.exp(0.1)], rel=1e-6)
    per_seq = weights_with_bound(d, seq, MismatchCorrection(mode="mask", level="sequence"), log_ratio_bound=20.0)
    assert per_seq.clamped.tolist() == [True, True, True, True, False]
    assert per_seq.affected.tolist() == [True, True, True, True, False]
