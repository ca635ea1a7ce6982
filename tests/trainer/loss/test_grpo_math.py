"""GRPO math against numbers computed by hand (in the comments)."""
from __future__ import annotations

import math

import pytest
import torch

from contract.trainer_settings import DEFAULT_LOG_RATIO_BOUND
from services.trainer.loss.policy_loss import ppo_clip_token_loss
from services.trainer.loss.surrogate import (
    group_advantages,
    k3,
    kl_to_reference,
    mismatch_stats,
    reward_stats,
)

LN2 = math.log(2.0)


def test_group_advantages_hand_computed():
    # Group a = [1, 0, 0]: mean 1/3, population var ((2/3)^2 + 2 (1/3)^2) / 3 = 2/9,
    # std sqrt(2)/3 -> advantages (2/3)/(sqrt2/3) = sqrt2 and (-1/3)/(sqrt2/3) = -1/sqrt2.
    # Group b = [1, 3] (interleaved with a): mean 2, std 1 -> -1, +1.
    # Group c = [5]: one sample -> std 0 -> advantage 0 (no signal, no NaN).
    rewards = [1.0, 1.0, 0.0, 3.0, 0.0, 5.0]
    groups = ["a", "b", "a", "b", "a", "c"]
    adv = group_advantages(rewards, groups, eps=0.0)
    expected = [math.sqrt(2), -1.0, -1 / math.sqrt(2), 1.0, -1 / math.sqrt(2), 0.0]
    assert adv == pytest.approx(expected, abs=1e-12)


def test_group_advantages_without_std_is_dr_grpo():
    # Dr. GRPO: reward - group mean, no division. Group a = [1, 0, 0]: mean 1/3 -> 2/3, -1/3, -1/3;
    # group b = [1, 3]: mean 2 -> -1, +1 (std 1, so the same as with std); group c = [5] -> 0.
    # Group d = [4, 0]: mean 2, std 2 -> +-2 without std, +-1 with it.
    rewards = [1.0, 1.0, 0.0, 3.0, 0.0, 5.0, 4.0, 0.0]
    groups = ["a", "b", "a", "b", "a", "c", "d", "d"]
    adv = group_advantages(rewards, groups, std_normalization=False)
    assert adv == pytest.approx([2 / 3, -1.0, -1 / 3, 1.0, -1 / 3, 0.0, 2.0, -2.0], abs=1e-12)
    assert group_advantages(rewards, groups, eps=0.0)[6:] == pytest.approx([1.0, -1.0], abs=1e-12)


def test_group_advantages_eps_and_tensor_input():
    # Rewards [0, 1]: mean 0.5, std 0.5 -> +-0.5 / (0.5 + 0.5) = +-0.5 with eps = 0.5.
    assert group_advantages(torch.tensor([0.0, 1.0]), ["g", "g"], eps=0.5) == pytest.approx([-0.5, 0.5])
    # Default eps (1e-6) barely moves a unit-std group.
    assert group_advantages([0.0, 2.0], ["g", "g"]) == pytest.approx([-1.0, 1.0], abs=1e-5)
    # All-equal group: zero advantages, not NaN.
    assert group_advantages([0.7, 0.7, 0.7], ["g"] * 3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "rewards, groups, match",
    [([1.0, 2.0], ["g"], "2 values for 1 group ids"), ([1.0, float("nan")], ["g", "g"], r"rewards\[1\]")],
)
def test_group_advantages_refuses_bad_input(rewards, groups, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, groups)


def test_ppo_clip_token_loss_hand_computed():
    # ratio, advantage -> loss = -min(r A, clip(r, 0.8, 1.2) A), clipped?
    # 1.5, +1 -> -min(1.5, 1.2) = -1.2, clipped (no gradient)
    # 1.5, -1 -> -min(-1.5, -1.2) = 1.5, not clipped (pessimistic branch keeps the gradient)
    # 0.5, +1 -> -min(0.5, 0.8) = -0.5, not clipped
    # 0.5, -1 -> -min(-0.5, -0.8) = 0.8, clipped
    # 1.0, +2 -> -2.0, not clipped
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0], dtype=torch.float64)
    rollout = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1], dtype=torch.float64)
    logp = (rollout + ratio.log()).requires_grad_(True)
    token = ppo_clip_token_loss(logp, rollout, adv, clip_low=0.2, clip_high=0.2, log_ratio_bound=DEFAULT_LOG_RATIO_BOUND)
    loss, clipped = token.loss, token.clipped
    assert loss.tolist() == pytest.approx([-1.2, 1.5, -0.5, 0.8, -2.0], abs=1e-12)
    assert clipped.tolist() == [True, False, False, True, False]
    # d loss / d logp = -r A where unclipped, 0 where clipped.
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1.5, -0.5, 0.0, -2.0], abs=1e-12)


def test_ppo_clip_asymmetric_high():
    # clip_eps_high 0.28 (DAPO): ratio 1.25 with A>0 is inside (1.25 < 1.28), 1.3 is clipped to 1.28.
    rollout = torch.zeros(2, dtype=torch.float64)
    logp = torch.tensor([math.log(1.25), math.log(1.3)], dtype=torch.float64)
    token = ppo_clip_token_loss(logp, rollout, torch.ones(2, dtype=torch.float64),
                                clip_low=0.2, clip_high=0.28, log_ratio_bound=DEFAULT_LOG_RATIO_BOUND)
    loss, clipped = token.loss, token.clipped
    assert loss.tolist() == pytest.approx([-1.25, -1.28], abs=1e-12)
    assert clipped.tolist() == [False, True]


def test_k3_and_reference_kl_hand_computed():
    # k3(d) = e^d - d - 1: d = ln2 -> 2 - 0.693147 - 1 = 0.306853; d = 0 -> 0.
    assert k3(torch.tensor([LN2, 0.0], dtype=torch.float64)).tolist() == pytest.approx([1 - LN2, 0.0], abs=1e-12)
    # Policy p = 0.5, reference q = 0.25: d = ln(q/p) = -ln2 -> 0.5 + ln2 - 1 = 0.193147.
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    kl = kl_to_reference(logp, torch.tensor([math.log(0.25)], dtype=torch.float64))
    assert kl.item() == pytest.approx(LN2 - 0.5, abs=1e-12)
    # d/dlogp [e^(ref-logp) - (ref-logp) - 1] = -e^(ref-logp) + 1 = 0.5.
    kl.backward()
    assert logp.grad.item() == pytest.approx(0.5, abs=1e-12)


def test_mismatch_stats_hand_computed():
    # d = logp - rollout = [0, ln2, -ln2] -> IW [1, 2, 0.5]: mean 7/6, min 0.5, max 2.
    # |d| mean 2 ln2 / 3, max ln2. k3 = [0, 1 - ln2, ln2 - 0.5] -> mean 0.5 / 3.
    # m2 = mean(d^2) = 2 ln2^2 / 3 (M2PO's and AReaL's definition, no 1/2).
    rollout = torch.tensor([-1.0, -2.0, -0.5])
    logp = rollout + torch.tensor([0.0, LN2, -LN2])
    s = mismatch_stats(logp, rollout)
    assert s.iw_mean == pytest.approx(7 / 6, rel=1e-6)
    assert (s.iw_min, s.iw_max) == (pytest.approx(0.5, rel=1e-6), pytest.approx(2.0, rel=1e-6))
    assert s.logprob_abs_diff_mean == pytest.approx(2 * LN2 / 3, rel=1e-6)
    assert s.logprob_abs_diff_max == pytest.approx(LN2, rel=1e-6)
    assert s.approx_kl_k3 == pytest.approx(1 / 6, rel=1e-6)
    assert s.m2po_m2 == pytest.approx(2 * LN2**2 / 3, rel=1e-6)


def test_mismatch_stats_identical_is_exact():
    x = torch.tensor([-0.3, -2.5, -7.0])
    s = mismatch_stats(x, x.clone())
    assert (s.iw_mean, s.iw_min, s.iw_max, s.logprob_abs_diff_max, s.approx_kl_k3, s.m2po_m2) == (1, 1, 1, 0, 0, 0)


def test_mismatch_stats_refuses_bad_shapes():
    with pytest.raises(ValueError, match="shapes"):
        mismatch_stats(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="no response tokens"):
        mismatch_stats(torch.zeros(0), torch.zeros(0))


def test_reward_stats():
    # [1, 0, 0, 1]: mean 0.5, population std 0.5.
    assert reward_stats([1.0, 0.0, 0.0, 1.0]) == (0.5, 0.5)
