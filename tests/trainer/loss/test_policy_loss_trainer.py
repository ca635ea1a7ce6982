"""GSPO, M2PO and the sequence aggregations through the real trainer (tiny Qwen3, CPU).

The trajectories report rollout log-probs shifted by a fixed per-token offset Δ (= logp - rollout_logp),
the way stale or mismatched rollouts would, so that M2PO has tokens to mask and GSPO sequences to clip;
the step-1 parity gate is opened wide for it. The expected masks are computed from that Δ with the pure
functions.

Microbatch split: the update is a sum of per-microbatch gradients whose divisors are step-wide constants,
so splitting changes only the float32 summation order of the gradients (and which rows share a packed
buffer): ~1e-7 relative. AdamW's first step moves a weight by lr * g / (|g| + eps), which for the default
eps (1e-8) turns a gradient near eps into a coin flip of +-lr; so these tests set eps = 1 and lr = 1, where
the step is g / (|g| + 1): a faithful image of the gradient. The weight changes must then agree within
5e-7 absolute (a few float32 ulps of a weight of magnitude 1, where the subtraction rounds) and 1e-4
relative; a wrong divisor (a microbatch's own token or sequence count) reweights whole microbatches and
changes them by far more.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from trainer_support import on_policy_request

from services.trainer.loss.policy_loss import m2po_keep_mask
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")

BASE = {"lr": 1e-2, "grad_clip": 1.0}
GROUPS, PER_GROUP = 3, 4


def configure(model_dir, **overrides) -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id="run", model_path=str(model_dir), seed=7, config_json=json.dumps(BASE | overrides))
    return t


OPEN_GATE = {"iw_mean_tolerance": 10.0, "iw_max": 1e3, "logprob_abs_diff_mean": 10.0}


def shifted_step(model_dir, *, scale: float, **overrides):
    """Step 1 on trajectories whose rollout log-probs are lowered by a fixed Δ per token."""
    t = configure(model_dir, parity_gate=OPEN_GATE, **overrides)
    req = on_policy_request(t, model_dir, 1, n_groups=GROUPS, per_group=PER_GROUP, seed=3)
    g = torch.Generator().manual_seed(100)
    samples, deltas = [], {}
    for s in req.samples:
        d = scale * torch.randn(s.num_response_tokens, generator=g)
        deltas[s.sample_id] = d
        samples.append(dataclasses.replace(s, rollout_logprobs=s.rollout_logprobs - d))
    req = dataclasses.replace(req, samples=samples)
    return t, t.train_step(req).metrics, req, deltas


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.master_state_dict().items()}


def assert_split_invariant(model_dir, *, scale: float, **overrides):
    runs = []
    for budget in (16, 4096):  # several microbatches vs one
        t = configure(model_dir)
        before = weights(t)
        t, m, _, _ = shifted_step(model_dir, scale=scale, microbatch_tokens=budget, lr=1.0, eps=1.0, **overrides)
        runs.append((m, {k: v - before[k] for k, v in weights(t).items()}))
    (ma, ua), (mb, ub) = runs
    for key in ("loss", "grad_norm", "clip_fraction", "seq_clip_fraction", "m2po_masked_fraction"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    assert max(u.abs().max() for u in ua.values()) > 1e-3  # the step did move the weights
    for k in ua:
        torch.testing.assert_close(ua[k], ub[k], rtol=1e-4, atol=5e-7)
    return ma


def canonical(req):
    from services.trainer.data.batching import canonical_order

    return canonical_order(req.samples)


def test_m2po_masks_the_steps_largest_mismatch_and_reports_it(tiny_model_dir):
    _, m1, _, _ = shifted_step(tiny_model_dir, scale=0.0, policy_loss={"kind": "m2po"})
    assert m1["m2po_masked_fraction"] == 0.0  # on-policy: Δ ~ 1e-7, nothing to mask
    _, m2, req, deltas = shifted_step(tiny_model_dir, scale=0.3, policy_loss={"kind": "m2po"})
    # The mask over the whole step, from Δ in canonical token order.
    delta = torch.cat([deltas[s.sample_id] for s in canonical(req)])
    keep = m2po_keep_mask(delta, 0.04)
    expected = (~keep).double().mean().item()
    assert 0 < expected < 0.5
    # The trainer's Δ is this one plus the ~1e-6 by which its log-probs differ from the rollout helper's.
    assert m2["m2po_masked_fraction"] == pytest.approx(expected, abs=1.01 / delta.numel())
    assert m2["m2po_m2"] == pytest.approx(delta.double().square().mean().item(), rel=1e-3)
    assert m2["clip_fraction"] == 0.0 and m2["seq_clip_fraction"] == 0.0  # M2PO never clips


def test_m2po_microbatch_split_does_not_change_the_update(tiny_model_dir):
    m = assert_split_invariant(tiny_model_dir, scale=0.3, policy_loss={"kind": "m2po"})
    assert m["m2po_masked_fraction"] > 0


def test_m2po_masks_what_ppo_clip_would_not_change(tiny_model_dir):
    # Same trajectories, two objectives: M2PO masks tokens and leaves the rest unclipped; PPO-clip clips.
    _, m_ppo, _, _ = shifted_step(tiny_model_dir, scale=0.3)
    _, m_m2po, _, _ = shifted_step(tiny_model_dir, scale=0.3, policy_loss={"kind": "m2po"})
    assert m_ppo["m2po_masked_fraction"] == 0.0 and m_ppo["clip_fraction"] > 0
    assert m_m2po["m2po_masked_fraction"] > 0 and m_m2po["loss"] != m_ppo["loss"]
    assert m_m2po["m2po_m2"] == m_ppo["m2po_m2"]  # the same pre-update mismatch


def test_gspo_clips_whole_sequences_by_their_sequence_ratio(tiny_model_dir):
    _, m1, _, _ = shifted_step(tiny_model_dir, scale=0.0, policy_loss={"kind": "gspo"})
    assert m1["seq_clip_fraction"] == 0.0 and m1["clip_fraction"] == 0.0  # on-policy: ratio 1 within 4e-4
    _, m2, req, deltas = shifted_step(tiny_model_dir, scale=0.01, policy_loss={"kind": "gspo"})
    clipped_seqs = clipped_tokens = 0
    ordered = canonical(req)
    for s in ordered:
        ratio = math.exp(float(deltas[s.sample_id].double().mean()))
        if (s.advantage > 0 and ratio > 1 + 4e-4) or (s.advantage < 0 and ratio < 1 - 3e-4):
            clipped_seqs += 1
            clipped_tokens += s.num_response_tokens
    assert 0 < clipped_seqs < len(ordered)
    assert m2["seq_clip_fraction"] == pytest.approx(clipped_seqs / len(ordered))
    assert m2["clip_fraction"] == pytest.approx(clipped_tokens / sum(s.num_response_tokens for s in ordered))
    assert m2["m2po_masked_fraction"] == 0.0


def test_gspo_microbatch_split_does_not_change_the_update(tiny_model_dir):
    m = assert_split_invariant(tiny_model_dir, scale=0.01, policy_loss={"kind": "gspo"},
                               loss_agg="seq_mean_token_mean")
    assert m["seq_clip_fraction"] > 0


@pytest.mark.parametrize("loss_agg, extra", [("seq_mean_token_mean", {}),
                                             ("seq_mean_token_sum_norm", {"loss_agg_tokens": 8})])
def test_sequence_aggregations_step_loss_and_split(tiny_model_dir, loss_agg, extra):
    t = configure(tiny_model_dir, loss_agg=loss_agg, **extra)
    req = on_policy_request(t, tiny_model_dir, 1, n_groups=GROUPS, per_group=PER_GROUP, seed=3)
    m = t.train_step(req).metrics
    # Ratio 1 at step 1, so each token's loss is -A of its sequence: a sequence's token mean is -A_i,
    # its token sum -A_i L_i. (GRPO advantages sum to 0 in a group, so the first is 0, where token_mean
    # would give -sum A_i L_i / N, nonzero for responses of different lengths.)
    G = len(req.samples)
    if loss_agg == "seq_mean_token_mean":
        expected = -sum(s.advantage for s in req.samples) / G
    else:
        expected = -sum(s.advantage * s.num_response_tokens for s in req.samples) / (8 * G)
    assert m["loss"] == pytest.approx(expected, abs=1e-5)
    assert_split_invariant(tiny_model_dir, scale=0.3, loss_agg=loss_agg, **extra)


def test_m2po_mask_spans_every_rank_of_a_group(tiny_model_dir):
    from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer

    # A small budget: several microbatches spread over two ranks; the mask must still be the step's.
    overrides = {"microbatch_tokens": 12, "policy_loss": {"kind": "m2po"}}
    _, single, req, _ = shifted_step(tiny_model_dir, scale=0.3, **overrides)
    group = GroupTrainer(GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=120))
    try:
        group.configure(run_id="run", model_path=str(tiny_model_dir), seed=7,
                        config_json=json.dumps(BASE | {"parity_gate": OPEN_GATE} | overrides))
        grouped = group.train_step(req).metrics
    finally:
        group.close()
    assert single["m2po_masked_fraction"] > 0
    assert {k: v for k, v in grouped.items() if k != "grad_norm"} == {k: v for k, v in single.items() if k != "grad_norm"}
