"""An async step's loss: behaviour = the rollout's log-probs, proximal = the trainer's own before the update.

A fixed_lag run with max_staleness 1 trains step 2 on a rollout of version 0 while the trainer holds
version 1. Through the real Trainer the step's loss and correction statistics must be those of
w = pi_v1 / pi_v0, with pi_v0 the rollout's log-probs as sent and pi_v1 scored independently here from the
trainer's weights before the update:
- TIS ('truncate'), MIS ('mask'), and M2PO with 'mask' are decoupled PPO: the ratio is against pi_v1
  (1 in value, nothing clipped) and each token's loss is weighted by the truncated or masked w;
- M2PO alone is M2PO's own objective (the source recipe's): the unclipped ratio against the behaviour
  policy, w in value, on the tokens its second-moment mask of log w keeps.
Each check fails if the behaviour log-probs were replaced by the trainer's recompute (w = 1, nothing masked)
or the proximal policy by the rollout's (or, for M2PO alone, the other way round): the test first checks
that each alternative gives a loss far outside its tolerance.
"""
from __future__ import annotations

import json

import pytest
import torch
from trainer_support import current_policy, make_episodes, rollout_logprobs

from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.loss.policy_loss import m2po_keep_mask
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer

CLIP = 0.2
# Opened so that a stale step gets through (the gate checks the trainer/rollout mismatch of synchronous
# steps, which a one-version-old rollout exceeds by design).
OPEN_GATE = {"iw_mean_tolerance": 10.0, "iw_max": 1e6, "logprob_abs_diff_mean": 10.0}
LOSSES = {
    "truncate": {"mismatch_correction": {"mode": "truncate", "upper": 2.0}},
    "mask": {"mismatch_correction": {"mode": "mask", "upper": 2.0}},
    "m2po": {"policy_loss": {"kind": "m2po"}},
    "m2po_mask": {"policy_loss": {"kind": "m2po"}, "mismatch_correction": {"mode": "mask", "upper": 2.0}},
}


def request(policy, step: int, version: int, seed: int) -> tuple[StepRequest, list[list[float]], list[float]]:
    """Step `step`'s rollout, made by `policy` (version `version`): its log-probs as the rollout reports them."""
    eps = make_episodes(n_groups=3, per_group=4, seed=seed)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    lps = [rollout_logprobs(policy, e["prompt"], e["response"]) for e in eps]
    samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                           torch.tensor(lp), e["reward"], a) for e, lp, a in zip(eps, lps, adv)]
    return StepRequest("run", step, version, samples), lps, [float(a) for a in adv]


@pytest.mark.usefixtures("restore_torch_globals")
@pytest.mark.parametrize("name", list(LOSSES))
def test_a_stale_step_weights_behaviour_logprobs_against_the_trainers_proximal_policy(tiny_model_dir, name):
    t = Trainer(num_threads=1)
    t.configure(run_id="run", model_path=str(tiny_model_dir), seed=3, config_json=json.dumps({
        "lr": 0.2, "clip_eps_low": CLIP, "clip_eps_high": CLIP, "loss_agg": "token_mean", "parity_gate": OPEN_GATE, **LOSSES[name]}))
    v0 = current_policy(t, tiny_model_dir)
    t.train_step(request(v0, 1, 0, seed=4)[0])  # step 1: sampled and trained at version 0
    v1 = current_policy(t, tiny_model_dir)  # the proximal policy of step 2

    step2, behaviour, adv = request(v0, 2, 0, seed=5)  # max_staleness 1: step 2's rollout is version 0's
    eps = make_episodes(n_groups=3, per_group=4, seed=5)
    proximal = [rollout_logprobs(v1, e["prompt"], e["response"]) for e in eps]
    delta = torch.tensor([p - b for ps, bs in zip(proximal, behaviour) for p, b in zip(ps, bs)], dtype=torch.float64)
    token_adv = torch.tensor([a for a, bs in zip(adv, behaviour) for _ in bs], dtype=torch.float64)
    w = delta.exp()
    # The test can tell the two policies apart: with the rollout as the PPO old policy the ratio is w, and
    # the clip would act on some tokens.
    would_clip = ((w > 1 + CLIP) & (token_adv > 0)) | ((w < 1 - CLIP) & (token_adv < 0))
    assert would_clip.any(), (delta.abs().max(), "the update of step 1 moved the policy too little to tell")

    m = t.train_step(step2).metrics
    m2po, decoupled = name.startswith("m2po"), name != "m2po"
    keep = torch.ones_like(delta)
    if m2po:  # the mask is of log w = proximal - behaviour in every mode
        threshold = json.loads(t.run.config.model_dump_json())["policy_loss"]["m2po_threshold"]
        keep = m2po_keep_mask(delta.float(), threshold).double()
        assert keep.sum() < keep.numel()  # w = 1 (the recompute as behaviour policy) would mask nothing
    in_band = (w >= 0.5) & (w <= 2.0)
    weight = (torch.clamp(w, max=2.0) if name == "truncate" else torch.where(in_band, w, 0.0) if decoupled
              else torch.ones_like(w))

    def loss(ratio: torch.Tensor) -> float:
        """token_mean of each kept token's PPO (or, for M2PO, unclipped) term at `ratio`, times its weight."""
        term = ratio * token_adv if m2po else torch.minimum(ratio * token_adv,
                                                            torch.clamp(ratio, 1 - CLIP, 1 + CLIP) * token_adv)
        return -(term * keep * weight).mean().item()

    expected = loss(torch.ones_like(w) if decoupled else w)
    other_old = loss(w if decoupled else torch.ones_like(w))  # the other policy as the PPO old one
    recompute_as_behaviour = -token_adv.mean().item()  # w = 1: no weight, no mask, ratio 1
    print(f"\n{name}: mean |log w| {delta.abs().mean():.3f}; loss {m['loss']:.5f}, expected {expected:.5f}, "
          f"with the other old policy {other_old:.5f}, with the recompute as behaviour {recompute_as_behaviour:.5f}")
    assert abs(expected - other_old) > 1e-3 and abs(expected - recompute_as_behaviour) > 1e-3
    assert m["loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert m["clip_fraction"] == 0.0  # decoupled: the ratio is 1 in value; M2PO: never clipped
    assert m["m2po_m2"] == pytest.approx((delta * delta).mean().item(), rel=1e-4)
    assert m["m2po_masked_fraction"] == pytest.approx(1 - keep.mean().item())
    assert m["is_weight_mean"] == pytest.approx(weight.mean().item(), rel=1e-4)
