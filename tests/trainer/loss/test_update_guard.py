"""A non-finite update is refused before it reaches the weights, naming the step and the tokens; stale
rollouts 90 nats away train finitely and are counted (tiny Qwen3 through the real Trainer, CPU)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from trainer_support import current_policy, on_policy_request, rollout_logprobs

from services.trainer.data.batching import canonical_order
from services.trainer.distributed import sharding
from services.trainer.loss.update_guard import NAMED_TOKENS, nonfinite_tokens, nonfinite_update
from services.trainer.trainer import StepFailed, Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")


def test_nonfinite_tokens_are_those_with_a_nonfinite_logp_loss_or_gradient():
    nan, inf = float("nan"), float("inf")
    got = nonfinite_tokens(torch.tensor([0.1, nan, 0.3, 0.4, 0.5]), torch.tensor([-1.0, -1.0, -inf, -1.0, -1.0]),
                           torch.tensor([0.0, 0.0, 0.0, inf, 1.0]))
    assert got.tolist() == [False, True, True, True, False]
    assert nonfinite_tokens(torch.tensor([0.1]), torch.tensor([-1.0]), None).tolist() == [False]


def test_refusal_names_the_step_and_the_tokens_in_microbatch_order():
    ids = ["a", "b", "c"]
    finite = [(torch.zeros(2, dtype=torch.bool), torch.tensor([0, 0]), torch.tensor([3, 4]))]
    assert nonfinite_update(5, loss=0.5, grad_norm=1.0, tokens=finite, sample_ids=ids) is None
    tokens = [(torch.tensor([False, True]), torch.tensor([2, 2]), torch.tensor([7, 8])),
              (torch.tensor([True]), torch.tensor([0]), torch.tensor([3]))]
    msg = nonfinite_update(5, loss=math.nan, grad_norm=math.nan, tokens=tokens, sample_ids=ids)
    assert msg.startswith("step 5: non-finite update refused, no weights changed (loss nan, gradient norm nan)")
    assert "2 response tokens" in msg and msg.endswith("c at position 8, a at position 3")
    many = [(torch.ones(20, dtype=torch.bool), torch.zeros(20, dtype=torch.long), torch.arange(20))]
    msg = nonfinite_update(2, loss=math.inf, grad_norm=1.0, tokens=many, sample_ids=ids)
    assert "20 response tokens" in msg and msg.count(" at position ") == NAMED_TOKENS and "(the first 8)" in msg
    # A gradient that overflowed inside the model: no token to blame, and the message says so.
    msg = nonfinite_update(3, loss=0.5, grad_norm=math.inf, tokens=finite, sample_ids=ids)
    assert msg.startswith("step 3:") and "arose inside the model's backward" in msg


def configure(model_dir, **overrides) -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id="run", model_path=str(model_dir), seed=7, config_json=json.dumps({"lr": 1e-2} | overrides))
    return t


def test_a_nan_log_prob_refuses_the_step_naming_its_tokens_and_leaves_the_weights(tiny_model_dir):
    # One sequence per microbatch (padded rows alone), step 1 trained normally; step 2's trajectories are
    # scored before a NaN goes into the embedding of a token only one response has. Masked attention gives
    # that position weight 0 elsewhere in the row, and 0 * NaN is NaN: every token of that sequence, and of
    # no other, gets a NaN log-prob.
    t = configure(tiny_model_dir, batching="padded", microbatch_tokens=1)
    t.train_step(on_policy_request(t, tiny_model_dir, 1, n_groups=2, per_group=3, seed=3))
    req = on_policy_request(t, tiny_model_dir, 2, n_groups=2, per_group=3, seed=3)
    ordered = canonical_order(req.samples)
    counts = torch.bincount(torch.cat([s.prompt_ids for s in ordered] + [s.response_ids for s in ordered]),
                            minlength=32)
    victim, token = next((s, tok) for s in ordered for tok in s.response_ids.tolist() if counts[tok] == 1)
    clean = t.master_state_dict()
    poisoned = dict(clean)
    embed = "model.embed_tokens.weight"
    poisoned[embed] = clean[embed].clone()
    poisoned[embed][token] = float("nan")
    sharding.load_master_tensors(t.run.policy.lm, poisoned)
    before, adam = t.weights_digest(), {k: v.clone() for k, v in t.run.optimizer.state_dict()["state"][0].items()}
    with pytest.raises(StepFailed) as err:
        t.train_step(req)
    msg = str(err.value)
    prompt = victim.prompt_ids.numel()
    bad = [f"{victim.sample_id} at position {prompt + j}" for j in range(victim.response_ids.numel())]
    assert msg.startswith("step 2: non-finite update refused, no weights changed (loss nan")
    more = f" (the first {NAMED_TOKENS})" if len(bad) > NAMED_TOKENS else ""
    assert msg.endswith(f"; {len(bad)} response tokens have a non-finite log-prob, loss or log-prob gradient: "
                        + ", ".join(bad[:NAMED_TOKENS]) + more)
    assert t.weights_digest() == before and t.run.policy_version == 1
    assert all(torch.equal(v, t.run.optimizer.state_dict()["state"][0][k]) for k, v in adam.items())
    # With the weights repaired the same step trains: nothing of the refused one was left behind.
    sharding.load_master_tensors(t.run.policy.lm, clean)
    assert math.isfinite(t.train_step(req).metrics["loss"]) and t.run.policy_version == 2


@pytest.mark.parametrize("spec", [{}, {"policy_loss": {"kind": "gspo"}}, {"policy_loss": {"kind": "m2po"}},
                                  {"kl_coef": 0.1}])
def test_rollouts_90_nats_off_train_finitely_and_are_counted(tiny_model_dir, spec):
    # At temperature 0.002 the tiny model's log-probs spread down to about -240, so a rollout can have sampled
    # a token 90 nats more likely than the trainer now finds it (rollout = logp + 90 <= 0) as well as 90 less.
    temp = 0.002
    t = configure(tiny_model_dir, temperature=temp, parity_gate={"iw_max": 1e300, "iw_mean_tolerance": 1e300,
                                                                 "logprob_abs_diff_mean": 1e3}, **spec)
    req = on_policy_request(t, tiny_model_dir, 1, n_groups=2, per_group=4, seed=5)
    policy = current_policy(t, tiny_model_dir)
    samples, deltas = [], {}
    for s in req.samples:
        logp = torch.tensor(rollout_logprobs(policy, s.prompt_ids.tolist(), s.response_ids.tolist(), temperature=temp))
        d = torch.where(logp < -95, torch.tensor(-90.0), torch.tensor(90.0))
        deltas[s.sample_id] = d
        samples.append(dataclasses.replace(s, rollout_logprobs=logp - d))
    assert any((d < 0).any() for d in deltas.values()) and any((d > 0).any() for d in deltas.values())
    m = t.train_step(dataclasses.replace(req, samples=samples)).metrics
    assert all(math.isfinite(v) for v in m.values()), m
    assert t.run.policy_version == 1  # applied, not refused
    ordered = canonical_order(req.samples)
    if spec.get("policy_loss", {}).get("kind") == "gspo":  # whole sequences, by their mean log-ratio
        clamped = sum(s.num_response_tokens for s in ordered if deltas[s.sample_id].mean().abs() > 10)
        assert clamped > 0
    else:  # every token
        clamped = sum(s.num_response_tokens for s in ordered)
    assert m["log_ratio_clamped_tokens"] == clamped
    if clamped == sum(s.num_response_tokens for s in ordered) and "kl_coef" not in spec:
        assert m["grad_norm"] == 0.0  # a clamped ratio is a constant: no gradient at all
