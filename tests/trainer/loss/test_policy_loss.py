"""Policy objectives (PPO-clip, GSPO, M2PO) and loss aggregation against hand-computed numbers, GSPO at its
clip edge, and the log-ratio bounds (tests/trainer/loss/test_loss_oracle.py compares them all with float64)."""
from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from contract.trainer_run import TrainerRunConfig
from services.trainer.data.wire import InvalidRequest
from services.trainer.loss.policy_loss import (
    StepShape,
    aggregate_loss,
    gspo_sequence_ratio,
    gspo_token_loss,
    m2po_keep_mask,
    m2po_token_loss,
    microbatch_loss,
    ppo_clip_token_loss,
    sequence_mean,
)
from services.trainer.loss.surrogate import step_metrics
from services.trainer.run_setup import parse_run_config

# ------------------------------------------------------------ M2PO --


def test_m2po_masks_the_largest_squares_until_the_rest_meets_the_threshold():
    # Δ^2 = [0.01, 0.25, 0.04, 0.0025, 0.09]; descending 0.25, 0.09, 0.04, 0.01, 0.0025.
    # Means of what is left after masking k of them: k=0 0.3925/5 = 0.0785, k=1 0.1425/4 = 0.035625,
    # k=2 0.0525/3 = 0.0175.
    delta = torch.tensor([0.1, -0.5, 0.2, 0.05, 0.3])
    keep = m2po_keep_mask(delta, 0.04)  # 0.0785 > 0.04 >= 0.035625: mask the 0.25 alone
    assert keep.tolist() == [True, False, True, True, True]
    assert delta.double()[keep].square().mean().item() == pytest.approx(0.035625, rel=1e-6)
    keep = m2po_keep_mask(delta, 0.03)  # 0.035625 > 0.03: the 0.09 goes too
    assert keep.tolist() == [True, False, True, True, False]
    assert delta.double()[keep].square().mean().item() == pytest.approx(0.0175, rel=1e-6)
    assert m2po_keep_mask(delta, 0.08).all()  # 0.0785 already meets it: nothing masked


def test_m2po_threshold_is_inclusive_ties_go_in_token_order_and_one_token_always_stays():
    # Exact binary values: Δ^2 = [1/16, 1/16, 1/4]. Masking the 1/4 leaves mean exactly 1/16 = the
    # threshold, which is enough (M2 <= tau); a strict test would mask a second token.
    assert m2po_keep_mask(torch.tensor([0.25, -0.25, 0.5]), 0.0625).tolist() == [True, True, False]
    # Δ^2 = [1/4, 1/4, 0, 0]: mean 1/8 > 0.1, after one mask 1/12 <= 0.1. Of the tied 1/4s the first
    # in token order is masked.
    assert m2po_keep_mask(torch.tensor([0.5, -0.5, 0.0, 0.0]), 0.1).tolist() == [False, True, True, True]
    # Every Δ^2 above the threshold: only the smallest is kept, so the step still has a loss.
    assert m2po_keep_mask(torch.tensor([1.0, -2.0, 3.0]), 0.04).tolist() == [True, False, False]


def test_m2po_refuses_bad_input():
    with pytest.raises(ValueError, match="threshold must be > 0"):
        m2po_keep_mask(torch.tensor([0.1]), 0.0)
    with pytest.raises(ValueError, match="no tokens"):
        m2po_keep_mask(torch.tensor([]), 0.04)


def test_m2po_loss_is_the_unclipped_ratio_on_kept_tokens_only():
    # ratio = exp(Δ) = [2, 0.5, 4]; A = [1, -1, 1]; token 2 masked.
    old = torch.tensor([-1.0, -2.0, -3.0])
    logp = (old + torch.tensor([math.log(2), -math.log(2), math.log(4)])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0])
    out = m2po_token_loss(logp, old, adv, torch.tensor([True, True, False]), log_ratio_bound=20.0)
    # -r A: -2 (no clip at 1.2 even though PPO would), +0.5, and 0 for the masked token.
    assert out.loss.tolist() == pytest.approx([-2.0, 0.5, 0.0], rel=1e-6)
    assert not out.clipped.any()
    out.loss.sum().backward()
    # d(-r A)/d logp = -r A: the masked token gets no gradient.
    assert logp.grad.tolist() == pytest.approx([-2.0, 0.5, 0.0], rel=1e-6)


# ------------------------------------------------------------ GSPO --


def test_gspo_sequence_ratio_and_clipping_hand_computed():
    # Sequence 0: Δ = [0.1, 0.3] -> s0 = e^0.2 = 1.2214, A = +1: above 1 + 0.2, clipped (loss -1.2, no grad).
    # Sequence 1: Δ = [-0.1]     -> s1 = e^-0.1 = 0.9048, A = -1: inside [0.8, 1.2], loss +0.9048.
    # Sequence 2: Δ = [0.05, -0.05, 0.0] -> s2 = 1, A = +2: loss -2.
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7, -0.2])
    delta = torch.tensor([0.1, 0.3, -0.1, 0.05, -0.05, 0.0])
    logp = (old + delta).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0, 2.0, 2.0])
    index = torch.tensor([0, 0, 1, 2, 2, 2])
    out = gspo_token_loss(logp, old, adv, index, clip_low=0.2, clip_high=0.2, log_ratio_bound=10.0)
    s1 = math.exp(-0.1)
    assert out.loss.tolist() == pytest.approx([-1.2, -1.2, s1, -2.0, -2.0, -2.0], rel=1e-6)
    assert out.clipped.tolist() == [True, True, False, False, False, False]
    out.loss.sum().backward()
    # GSPO-token: d s_t / d logp_t = s (the sequence ratio), so each unclipped token's gradient is -A s.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, s1, -2.0, -2.0, -2.0], rel=1e-6)


def test_gspo_with_sequence_mean_aggregation_is_the_sequence_level_objective():
    # GSPO's objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i) with s_i = exp(mean_t Δ_it), differentiated
    # directly, against the token form aggregated with seq_mean_token_mean.
    # Sequence means of Δ: +1e-3 (A > 0: ratio above 1 + 4e-4, clipped), -1e-3 (A < 0: below 1 - 3e-4,
    # clipped), +1e-4 (inside the band).
    index = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    old = -torch.rand(9, generator=torch.Generator().manual_seed(0)) * 3
    logp0 = old + torch.tensor([2e-3, 0.0, 1e-3, -1.5e-3, -0.5e-3, 3e-4, -1e-4, 1e-4, 1e-4])
    adv = torch.tensor([1.0, -0.5, 2.0]).repeat_interleave(torch.tensor([3, 2, 4]))
    low, high = 3e-4, 4e-4

    logp = logp0.clone().requires_grad_()
    token = gspo_token_loss(logp, old, adv, index, clip_low=low, clip_high=high, log_ratio_bound=10.0)
    shape = StepShape(sequence_lengths=torch.tensor([3, 2, 4]))
    aggregate_loss(token.loss, index, shape, loss_agg="seq_mean_token_mean", loss_agg_tokens=None).backward()

    ref = logp0.clone().requires_grad_()
    seq_loss = []
    for i in range(3):
        sel = index == i
        s = torch.exp((ref[sel] - old[sel]).mean())
        a = adv[sel][0]
        seq_loss.append(-torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
    torch.stack(seq_loss).mean().backward()
    torch.testing.assert_close(logp.grad, ref.grad, rtol=1e-5, atol=1e-7)
    per_seq = [bool(token.clipped[index == i].all()) for i in range(3)]
    assert per_seq == [bool(token.clipped[index == i].any()) for i in range(3)]  # whole sequences
    assert per_seq == [True, True, False]
    assert logp.grad[index != 2].abs().max() == 0 and logp.grad[index == 2].abs().min() > 0


def test_sequence_mean_needs_no_adjacent_tokens():
    means, inverse = sequence_mean(torch.tensor([1.0, 10.0, 3.0, 20.0]), torch.tensor([5, 2, 5, 2]))
    assert means.dtype == torch.float64 and means[inverse].tolist() == [2.0, 15.0, 2.0, 15.0]


# ------------------------------------------------------------ aggregation --


LOSSES = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
INDEX = torch.tensor([0, 0, 0, 1, 2, 2])
SHAPE = StepShape(sequence_lengths=torch.tensor([3, 1, 2]))


@pytest.mark.parametrize("loss_agg, tokens, expected", [
    ("token_mean", None, 21 / 6),                                # (1+...+6) / 6 tokens
    ("seq_mean_token_mean", None, (2.0 + 4.0 + 5.5) / 3),        # token means 2, 4, 5.5 over 3 sequences
    ("seq_mean_token_sum_norm", 4, (6 / 4 + 4 / 4 + 11 / 4) / 3),  # token sums 6, 4, 11 over C = 4, mean
])
def test_aggregations_hand_computed_and_split_invariant(loss_agg, tokens, expected):
    whole = aggregate_loss(LOSSES, INDEX, SHAPE, loss_agg=loss_agg, loss_agg_tokens=tokens)
    assert whole.item() == pytest.approx(expected, rel=1e-6)
    # Two microbatches (sequences 0 and 2, then 1): the shares add up to the same loss.
    a, b = torch.tensor([0, 1, 2, 4, 5]), torch.tensor([3])
    parts = sum(aggregate_loss(LOSSES[m], INDEX[m], SHAPE, loss_agg=loss_agg, loss_agg_tokens=tokens) for m in (a, b))
    assert parts.item() == pytest.approx(expected, rel=1e-6)


def test_token_keys_are_canonical_whatever_the_microbatch():
    # Sequences of 3, 1, 2 loss tokens: canonical token order is seq 0 -> 0..2, seq 1 -> 3, seq 2 -> 4..5;
    # a token's rank is its index among its own sequence's loss tokens.
    shape = StepShape(sequence_lengths=torch.tensor([3, 1, 2]))
    keys = shape.token_keys(torch.tensor([2, 2, 0, 0, 0, 1]), torch.tensor([0, 1, 0, 1, 2, 0]))
    assert keys.tolist() == [4, 5, 0, 1, 2, 3]
    assert shape.num_tokens == 6


def test_step_metrics_report_what_each_loss_masked_or_clipped():
    m = step_metrics(
        loss=0.5, logp=torch.tensor([-1.0, -1.0, -2.0, -0.5]), rollout_logp=torch.tensor([-1.5, -1.0, -2.0, -0.5]),
        clipped=torch.tensor([True, True, False, False]), clamped=torch.tensor([False, True, False, True]),
        sample_index=torch.tensor([0, 0, 1, 2]),
        m2po_keep=torch.tensor([False, True, True, True]), is_weight=torch.ones(4), is_affected=torch.zeros(4, dtype=torch.bool),
        entropy=torch.ones(4), kl=None, rewards=[1.0, 0.0, 1.0], num_tokens_total=10, grad_norm=1.0, lr=1e-5)
    assert m["clip_fraction"] == 0.5 and m["seq_clip_fraction"] == pytest.approx(1 / 3)
    assert m["m2po_masked_fraction"] == 0.25 and m["log_ratio_clamped_tokens"] == 2.0
    assert m["m2po_m2"] == pytest.approx(0.25 / 4)  # mean(Δ^2), Δ = [0.5, 0, 0, 0]
    assert m["response_length_mean"] == pytest.approx(4 / 3) and m["kl_ref"] == 0.0


# ------------------------------------------------------------ run spec --


@pytest.mark.parametrize("spec, message", [
    ({"policy_loss": {"kind": "m2po", "m2po_threshold": 0.0}}, "policy_loss.m2po_threshold: Input should be greater than 0"),
    ({"policy_loss": {"kind": "m2po", "m2po_threshold": -1.0}}, "policy_loss.m2po_threshold: Input should be greater than 0"),
    ({"policy_loss": {"kind": "gspo", "gspo_clip_low": -1e-4}}, "policy_loss.gspo_clip_low: Input should be greater than or equal to 0"),
    ({"policy_loss": {"kind": "gspo", "gspo_clip_high": -1e-4}}, "policy_loss.gspo_clip_high: Input should be greater than or equal to 0"),
    ({"policy_loss": {"kind": "ppo_clip", "m2po_threshold": 0.1}}, "m2po_threshold: only used by kind 'm2po'"),
    ({"policy_loss": {"kind": "m2po", "gspo_clip_high": 0.1}}, "gspo_clip_high: only used by kind 'gspo'"),
    ({"policy_loss": {"kind": "gspo"}, "mismatch_correction": {"mode": "truncate"}}, "policy_loss.kind: 'gspo' clips"),
    ({"policy_loss": {"kind": "dapo"}}, "policy_loss.kind: Input should be"),
    ({"loss_agg": "seq_mean_token_sum_norm"}, "loss_agg_tokens: required by loss_agg 'seq_mean_token_sum_norm'"),
    ({"loss_agg": "token_mean", "loss_agg_tokens": 512}, "loss_agg_tokens: required by"),
    ({"loss_agg": "seq_mean_token_sum_norm", "loss_agg_tokens": 0}, "loss_agg_tokens: Input should be greater than or equal to 1"),
    ({"advantage_std_normalization": "no"}, "advantage_std_normalization: Input should be a valid boolean"),
    ({"policy_loss": {"log_ratio_bound": 0.0}}, "policy_loss.log_ratio_bound: Input should be greater than 0"),
    ({"clip_eps_high": 0.5, "policy_loss": {"log_ratio_bound": 0.4}}, "policy_loss.log_ratio_bound: 0.4 lies inside"),
    ({"policy_loss": {"kind": "m2po", "gspo_log_ratio_bound": 5.0}}, "gspo_log_ratio_bound: only used by kind 'gspo'"),
    ({"mismatch_correction": {"mode": "mask", "upper": 2.0, "lower": 1e-10}}, "log_ratio_bound: 20.0 must exceed"),
])
def test_run_spec_refuses_nonsense_naming_the_field(spec, message):
    with pytest.raises(InvalidRequest) as err:
        parse_run_config(json.dumps(spec))
    assert message in str(err.value) and str(err.value).startswith("trainer_config_json")


def test_run_spec_defaults_and_sensible_combinations():
    default = TrainerRunConfig()
    assert default.policy_loss.kind == "ppo_clip" and default.loss_agg == "token_mean"
    assert default.advantage_std_normalization is True and default.loss_agg_tokens is None
    assert (default.policy_loss.m2po_threshold, default.policy_loss.gspo_clip_low,
            default.policy_loss.gspo_clip_high) == (0.04, 3e-4, 4e-4)
    assert (default.policy_loss.log_ratio_bound, default.policy_loss.gspo_log_ratio_bound) == (20.0, 10.0)
    # GSPO averages over sequences by default; a loss_agg the spec sets is kept.
    assert TrainerRunConfig.model_validate({"policy_loss": {"kind": "gspo"}}).loss_agg == "seq_mean_token_mean"
    assert TrainerRunConfig.model_validate({"policy_loss": {"kind": "gspo"}, "loss_agg": "token_mean"}).loss_agg \
        == "token_mean"
    # AReaL's M2PO recipe: decoupled ratio with masked IS weights.
    TrainerRunConfig.model_validate({"policy_loss": {"kind": "m2po"}, "mismatch_correction": {"mode": "mask", "upper": 5.0}})
    # Dr. GRPO.
    cfg = TrainerRunConfig.model_validate({"loss_agg": "seq_mean_token_sum_norm", "loss_agg_tokens": 1024,
                                           "advantage_std_normalization": False})
    # What the coordinator sends (every field, defaults included) parses back to the same config.
    assert TrainerRunConfig.model_validate_json(cfg.model_dump_json()) == cfg
    gspo = TrainerRunConfig.model_validate({"policy_loss": {"kind": "gspo", "gspo_clip_high": 1e-3}})
    assert TrainerRunConfig.model_validate_json(gspo.model_dump_json()) == gspo
    with pytest.raises(ValidationError):
        TrainerRunConfig.model_validate({"policy_loss": {"kind": "gspo"}, "mismatch_correction": {"mode": "mask"}})


# ------------------------------------------------------------ GSPO at the clip edge --


def test_gspo_reproducer_clips_neither_token_and_grads_them_equally():
    # True sequence ratio exp(mean(Δ)) = exp(0.00039959...) = 1.00039967, below the 1 + 4e-4 bound (and above
    # its float32 rounding's neighbour): no token is clipped, and both get the same gradient, -A s / 2.
    old = torch.tensor([-30.0, -0.01])
    logp = torch.tensor([-29.99959946, -0.00960136], requires_grad=True)
    index = torch.tensor([0, 0])
    s = math.exp((logp.detach().double() - old.double()).mean().item())
    assert 1 + 4e-4 - 4e-7 < s < 1 + 4e-4
    token = gspo_token_loss(logp, old, torch.ones(2), index, clip_low=3e-4, clip_high=4e-4, log_ratio_bound=10.0)
    assert token.clipped.tolist() == [False, False]
    shape = StepShape(sequence_lengths=torch.tensor([2]))
    aggregate_loss(token.loss, index, shape, loss_agg="seq_mean_token_mean", loss_agg_tokens=None).backward()
    assert logp.grad[0].item() == logp.grad[1].item() == pytest.approx(-s / 2, rel=1e-7)
    m = step_metrics(loss=0.0, logp=logp.detach(), rollout_logp=old, clipped=token.clipped, clamped=token.clamped,
                     sample_index=index, m2po_keep=None, is_weight=torch.ones(2), is_affected=torch.zeros(2, dtype=torch.bool),
                     entropy=torch.ones(2), kl=None, rewards=[1.0], num_tokens_total=3, grad_norm=1.0, lr=1.0)
    assert m["clip_fraction"] == 0.0 and m["seq_clip_fraction"] == 0.0


def test_gspo_sequence_ratio_is_one_value_per_sequence_bit_for_bit():
    # Tokens of very different log-prob magnitudes (whose float32 spacings differ by 10^5), sequences
    # interleaved, deltas up to 30: every token of a sequence holds the same float32 bits, the float32
    # rounding of the float64 ratio, and its gradient by its own log-prob is that same value.
    g = torch.Generator().manual_seed(5)
    n, seqs = 600, 40
    index = torch.randint(0, seqs, (n,), generator=g)
    old = -torch.exp(torch.empty(n).uniform_(math.log(1e-4), math.log(60.0), generator=g))
    delta = torch.randn(n, generator=g) * torch.exp(torch.empty(n).uniform_(math.log(1e-7), math.log(30.0), generator=g))
    logp = torch.minimum(old + delta, torch.zeros(n))
    old[index == 0], logp[index == 0] = -50.0, -25.0  # sequence 0: mean log-ratio 25, clamped to 10
    logp.requires_grad_()
    ratio = gspo_sequence_ratio(logp, old, index, log_ratio_bound=10.0)
    bits = ratio.ratio.detach().view(torch.int32)
    for i in range(seqs):
        sel = index == i
        assert bits[sel].unique().numel() == 1, f"sequence {i}: {ratio.ratio[sel].unique().tolist()}"
        mean = (logp.detach()[sel].double() - old[sel].double()).mean().item()
        want = torch.tensor(math.exp(min(max(mean, -10.0), 10.0)), dtype=torch.float64)
        assert ratio.ratio[sel][0].item() == pytest.approx(want.item(), rel=2 ** -23)
    ratio.ratio.sum().backward()
    live = ~ratio.clamped
    assert torch.equal(logp.grad[live], ratio.ratio.detach()[live]) and (logp.grad[~live] == 0).all()
    assert live.any() and (~live).any()


# ------------------------------------------------------------ bounded log-ratios --


LOSS_SPECS = {
    "ppo_clip": {},
    "ppo_clip+kl": {"kl_coef": 0.1},
    "gspo": {"policy_loss": {"kind": "gspo"}},
    "gspo+kl": {"policy_loss": {"kind": "gspo"}, "kl_coef": 0.1},
    "m2po": {"policy_loss": {"kind": "m2po"}},
    "m2po+mask": {"policy_loss": {"kind": "m2po"}, "mismatch_correction": {"mode": "mask"}},
    "tis_token": {"mismatch_correction": {"mode": "truncate"}},
    "tis_sequence": {"mismatch_correction": {"mode": "truncate", "level": "sequence"}},
    "mis_geometric": {"mismatch_correction": {"mode": "mask", "level": "geometric"}},
}


@pytest.mark.parametrize("agg", [{}, {"loss_agg": "token_mean"}, {"loss_agg": "seq_mean_token_mean"},
                                 {"loss_agg": "seq_mean_token_sum_norm", "loss_agg_tokens": 8}])
@pytest.mark.parametrize("name", LOSS_SPECS)
def test_log_ratio_deltas_of_90_give_finite_losses_gradients_and_metrics(name, agg):
    cfg = TrainerRunConfig.model_validate(LOSS_SPECS[name] | agg)
    # Six sequences: Δ = logp - rollout of +90 or -90 on whole sequences and on single tokens, A of every
    # sign (A = 0 is where an overflowed ratio used to give inf * 0 = NaN); the reference 90 away too.
    lengths = [3, 2, 4, 1, 3, 2]
    index = torch.arange(6).repeat_interleave(torch.tensor(lengths))
    delta = torch.tensor([90.0, 90, 90, -90, -90, 0.1, 90, -0.2, 0.3, 90, 0.0, 0.05, -90, -90, 0.2])
    logp = torch.full((15,), -95.0) + torch.linspace(0, 1, 15)
    rollout = logp - delta
    ref = logp + torch.tensor([0.0, 90, -90] * 5)
    adv = torch.tensor([1.0, -1.0, 0.0, 1.0, -1.0, 0.0]).repeat_interleave(torch.tensor(lengths))
    shape = StepShape(sequence_lengths=torch.tensor(lengths))
    leaf = logp.clone().requires_grad_()
    keep = m2po_keep_mask(delta, cfg.policy_loss.m2po_threshold) if cfg.policy_loss.kind == "m2po" else None
    out = microbatch_loss(cfg, leaf, rollout, adv, index, shape, m2po_keep=keep,
                          ref_logp=ref if cfg.kl_coef > 0 else None)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and torch.isfinite(out.token_loss).all()
    assert torch.isfinite(leaf.grad).all()
    # The clamped tokens: the policy ratio's (token log-ratio beyond 20, or for GSPO every token of a sequence
    # whose mean is beyond 10), the importance weight's (log w beyond 20; the decoupled ratio is 1) and the
    # KL term's.
    sums = torch.zeros(6).index_add_(0, index, delta)
    level = cfg.mismatch_correction.level
    if cfg.mismatch_correction.mode != "none" and level != "token":
        log_w = sums if level == "sequence" else sums / torch.tensor(lengths, dtype=torch.float32)
        expected = (log_w.abs() > 20)[index]
    elif cfg.policy_loss.kind == "gspo":
        expected = (sums / torch.tensor(lengths, dtype=torch.float32)).abs()[index] > 10
    else:
        expected = delta.abs() > 20
    if cfg.kl_coef > 0:
        expected = expected | ((ref - logp).abs() > 20)
    assert torch.equal(out.clamped, expected) and expected.any()
    m = step_metrics(loss=out.loss.item(), logp=logp, rollout_logp=rollout, clipped=out.clipped, clamped=out.clamped,
                     sample_index=index, m2po_keep=keep, is_weight=out.is_weight, is_affected=out.is_affected,
                     entropy=torch.ones(15), kl=out.kl, rewards=[1.0, 0.0] * 3, num_tokens_total=30,
                     grad_norm=float(leaf.grad.norm()), lr=1e-5)
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["log_ratio_clamped_tokens"] == float(expected.sum())


def test_the_bound_is_what_clamps_ppo_and_only_beyond_it():
    # Δ = 20 exactly is inside the bound: ratio e^20 with its gradient; 20.5 is clamped to e^20, no gradient.
    old = torch.tensor([-30.0, -30.0, -1.0])
    logp = (old + torch.tensor([20.0, 20.5, 0.1])).requires_grad_()
    out = ppo_clip_token_loss(logp, old, -torch.ones(3), clip_low=0.2, clip_high=0.2, log_ratio_bound=20.0)
    assert out.clamped.tolist() == [False, True, False]
    assert out.loss[0].item() == out.loss[1].item() == pytest.approx(math.exp(20), rel=1e-6)
    out.loss.sum().backward()
    assert logp.grad[0].item() == pytest.approx(math.exp(20), rel=1e-6) and logp.grad[1].item() == 0.0
