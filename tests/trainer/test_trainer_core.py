"""The trainer core in-process: step semantics, on-policy IW, determinism, checkpoints."""
from __future__ import annotations

import json
import math

import pytest
import torch
from trainer_support import VOCAB, current_policy, make_episodes, rollout_logprobs

from services.common.metric_defs import STEP_METRIC_HELP
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import FailedPrecondition, InvalidRequest, StepRequest
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer
from tests.support.rounding_bounds import response_logprob_bounds

pytestmark = pytest.mark.usefixtures("restore_torch_globals")

RUN_CONFIG = {"lr": 1e-2, "microbatch_tokens": 24, "grad_clip": 1.0}


def configure(model_dir, *, run_id="run", seed=11, **overrides) -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id=run_id, model_path=str(model_dir), seed=seed,
                config_json=json.dumps(RUN_CONFIG | overrides))
    return t


def on_policy_step(trainer: Trainer, step: int, *, temperature: float = 1.0, seed: int = 1) -> StepRequest:
    """Trajectories scored by the trainer's current weights, as a rollout at that version would report."""
    eps = make_episodes(seed=seed + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    model = trainer.run.model
    samples = [
        TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                    torch.tensor(rollout_logprobs(model, e["prompt"], e["response"], temperature=temperature)),
                    e["reward"], a)
        for e, a in zip(eps, adv)
    ]
    return StepRequest(trainer.run.run_id, step, step - 1, samples)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.master_state_dict().items()}


def test_step1_on_policy_metrics(tiny_model_dir):
    t = configure(tiny_model_dir, temperature=0.7)
    req = on_policy_step(t, 1, temperature=0.7)
    before = weights(t)
    # Same weights on both sides before the update: the packed trainer and the one-sequence rollout
    # differ by float32 rounding only, bounded per token from u and this model's values.
    bound = response_logprob_bounds(current_policy(t, tiny_model_dir),
                                    [(s.prompt_ids.tolist(), s.response_ids.tolist()) for s in req.samples],
                                    temperature=0.7)
    out = t.train_step(req)
    m = out.metrics
    assert list(m) == [k for k in STEP_METRIC_HELP if k != "eval_accuracy"]
    assert not out.replayed and out.policy_version == 1 and t.run.policy_version == 1
    b = bound.max().item()
    assert abs(m["iw_mean"] - 1) <= torch.expm1(bound).mean().item()
    assert m["iw_min"] >= math.exp(-b) and m["iw_max"] <= math.exp(b) and m["logprob_abs_diff_max"] <= b
    # k3(d) = e^d - d - 1 <= e^|d| - |d| - 1, reduced in float64 (three roundings of values near 1).
    assert m["approx_kl_k3"] <= (torch.expm1(bound) - bound).mean().item() + 3 * torch.finfo(torch.float64).eps
    assert m["clip_fraction"] == 0
    n_resp = sum(s.num_response_tokens for s in req.samples)
    assert m["tokens_response"] == n_resp
    assert m["tokens_total"] == sum(s.num_tokens for s in req.samples)
    assert m["response_length_mean"] == pytest.approx(n_resp / len(req.samples))
    assert m["reward_mean"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx(0.5)
    assert 0 < m["entropy"] <= torch.log(torch.tensor(float(VOCAB))).item() + 1e-6
    assert m["kl_ref"] == 0.0 and m["grad_norm"] > 0
    # With ratio 1 the PPO loss is -sum_t A_t / N (token mean of the advantages, negated).
    expected_loss = -sum(s.advantage * s.num_response_tokens for s in req.samples) / n_resp
    assert m["loss"] == pytest.approx(expected_loss, abs=1e-5)
    assert any(not torch.equal(before[k], v) for k, v in weights(t).items())


def test_replay_and_version_rules(tiny_model_dir):
    t = configure(tiny_model_dir)
    req1 = on_policy_step(t, 1)
    first = t.train_step(req1)
    after1 = weights(t)
    replay = t.train_step(StepRequest("run", 1, 0, []))  # the coordinator replays with no trajectories
    assert replay.replayed and replay.metrics == first.metrics and replay.policy_version == 1
    assert all(torch.equal(after1[k], v) for k, v in weights(t).items())
    with pytest.raises(FailedPrecondition, match="holds policy_version 1; step 3 needs 2"):
        t.train_step(on_policy_step(t, 3))
    with pytest.raises(InvalidRequest, match="step 2 has not been applied and needs trajectories"):
        t.train_step(StepRequest("run", 2, 1, []))
    with pytest.raises(FailedPrecondition, match="not the configured run"):
        t.train_step(StepRequest("other", 2, 1, req1.samples))
    bad = req1.samples[0]
    oob = TrainSample(bad.sample_id, bad.group_id, bad.prompt_ids, torch.tensor([VOCAB]), torch.tensor([-1.0]), 0.0, 0.0)
    with pytest.raises(InvalidRequest, match=rf"trajectory\[0\]\.response_token_ids: token id {VOCAB} >= vocab size"):
        t.train_step(StepRequest("run", 2, 1, [oob]))
    assert t.run.policy_version == 1


def test_configure_same_run_keeps_state(tiny_model_dir):
    t = configure(tiny_model_dir)
    t.train_step(on_policy_step(t, 1))
    held = weights(t)
    run = t.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(RUN_CONFIG))
    assert run.policy_version == 1 and all(torch.equal(held[k], v) for k, v in weights(t).items())
    with pytest.raises(FailedPrecondition, match="different seed"):
        t.configure(run_id="run", model_path=str(tiny_model_dir), seed=12, config_json=json.dumps(RUN_CONFIG))
    with pytest.raises(FailedPrecondition, match="different trainer_config_json"):
        t.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(RUN_CONFIG | {"lr": 1}))
    assert t.configure(run_id="new", model_path=str(tiny_model_dir), seed=11, config_json="{}").policy_version == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(config_json='{"lr": -1}'), "trainer_config_json.lr: Input should be greater than 0"),
        (dict(config_json='{"learning_rate": 1}'), "trainer_config_json.learning_rate: Extra inputs are not permitted"),
        (dict(config_json='{"lr": '), "trainer_config_json: Invalid JSON"),
        (dict(model_path="/nonexistent/model"), "model_path: /nonexistent/model is not a directory"),
        (dict(run_id=""), "run_id: empty"),
        (dict(resume_checkpoint="/nonexistent/ckpt"), "resume_checkpoint: /nonexistent/ckpt: not a Lockstep"),
    ],
)
def test_configure_refuses_bad_input_naming_the_field(tiny_model_dir, kwargs, message):
    args = dict(run_id="run", model_path=str(tiny_model_dir), seed=0, config_json="{}") | kwargs
    with pytest.raises(InvalidRequest, match=message):
        Trainer().configure(**args)


def test_same_seed_same_trajectories_bitwise_identical(tiny_model_dir):
    def run_twice_steps():
        t = configure(tiny_model_dir)
        metrics = [t.train_step(on_policy_step(t, s)).metrics for s in (1, 2)]
        return metrics, weights(t)

    m1, w1 = run_twice_steps()
    m2, w2 = run_twice_steps()
    assert m1 == m2  # exact float equality, every key
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert m1[0]["loss"] != m1[1]["loss"]  # two different steps, not one result twice


def test_microbatch_split_does_not_change_the_update(tiny_model_dir):
    results = []
    for budget in (8, 4096):  # many small microbatches vs one
        t = configure(tiny_model_dir, microbatch_tokens=budget)
        m = t.train_step(on_policy_step(t, 1)).metrics
        results.append((m, weights(t)))
    (ma, wa), (mb, wb) = results
    for key in ("loss", "grad_norm", "entropy", "iw_mean"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)


def test_reference_kl(tiny_model_dir):
    t = configure(tiny_model_dir, kl_coef=0.1)
    assert t.run.ref_model is not None
    assert t.train_step(on_policy_step(t, 1)).metrics["kl_ref"] == 0.0  # policy == reference before the update
    assert t.train_step(on_policy_step(t, 2)).metrics["kl_ref"] > 0


def test_checkpoint_round_trip_and_resume(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = configure(tiny_model_dir)
    for s in (1, 2):
        t.train_step(on_policy_step(t, s))
    ckpt_dir, version = t.save_checkpoint("run", str(tmp_path / "step_2"))
    assert version == 2
    names = {p.name for p in ckpt_dir.iterdir()}
    assert {"config.json", "model.safetensors", "optimizer.pt", "lockstep_trainer_state.json",
            "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.startswith(".") for n in {p.name for p in tmp_path.iterdir()})  # no temp dirs left
    at2 = weights(t)

    # A plain Hugging Face directory: loads with the Auto classes, same weights.
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32)
    assert all(torch.equal(hf.state_dict()[k], v) for k, v in at2.items())
    assert AutoTokenizer.from_pretrained(str(ckpt_dir)).convert_tokens_to_ids("w5") == 5

    # Resume in a fresh trainer: same version, same recorded metrics, and the
    # next step is bitwise what the uninterrupted trainer computes.
    r = Trainer(num_threads=1)
    r.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(RUN_CONFIG),
                resume_checkpoint=str(ckpt_dir))
    assert r.run.policy_version == 2 and r.run.step_metrics == t.run.step_metrics
    assert set(t.run.step_metrics) == {2}  # only the replayable step is kept: state does not grow per step
    assert r.train_step(StepRequest("run", 2, 1, [])).replayed
    step3 = on_policy_step(t, 3)
    assert r.train_step(step3).metrics == t.train_step(step3).metrics
    assert all(torch.equal(v, weights(r)[k]) for k, v in weights(t).items())

    # LoadCheckpoint into the held run rolls weights and version back.
    assert t.load_checkpoint("run", str(ckpt_dir)) == 2
    assert all(torch.equal(at2[k], v) for k, v in weights(t).items())
    with pytest.raises(InvalidRequest, match="directory: checkpoint belongs to run 'run', not 'other'"):
        configure(tiny_model_dir, run_id="other").load_checkpoint("other", str(ckpt_dir))
    with pytest.raises(InvalidRequest, match="resume_checkpoint: belongs to run 'run'"):
        Trainer().configure(run_id="other", model_path=str(tiny_model_dir), seed=0, config_json="{}",
                            resume_checkpoint=str(ckpt_dir))


def test_weight_tensors_cover_the_model_once(tiny_model_dir):
    t = configure(tiny_model_dir)
    snap = t.weight_tensors("run")
    names = [n for n, _ in snap.tensors]
    assert snap.policy_version == 0 and len(names) == len(set(names)) == len(t.master_state_dict())
    t.check_weights_unchanged(snap)
    t.train_step(on_policy_step(t, 1))
    with pytest.raises(FailedPrecondition, match="weights of policy_version 0 changed while they were being read"):
        t.check_weights_unchanged(snap)
    with pytest.raises(FailedPrecondition, match="no run configured"):
        Trainer().weight_tensors("run")


def _with_reward(sample: TrainSample, reward: float) -> TrainSample:
    return TrainSample(sample.sample_id, sample.group_id, sample.prompt_ids, sample.response_ids,
                       sample.rollout_logprobs, reward, sample.advantage)


def test_replay_is_checked_against_the_trajectories_the_step_was_trained_on(tiny_model_dir, tmp_path):
    t = configure(tiny_model_dir)
    req = on_policy_step(t, 1)
    first = t.train_step(req)
    after = weights(t)
    # The same trajectories in another order: a replay, the recorded metrics.
    shuffled = StepRequest("run", 1, 0, list(reversed(req.samples)))
    again = t.train_step(shuffled)
    assert again.replayed and again.metrics == first.metrics
    # One reward changed, one trajectory left out, one extra: refused naming the step, nothing changed.
    changed = [_with_reward(req.samples[0], 1.0 - req.samples[0].reward), *req.samples[1:]]
    extra = on_policy_step(t, 1, seed=40).samples[:1]
    for samples in (changed, req.samples[1:], [*req.samples, *extra]):
        with pytest.raises(FailedPrecondition, match="step 1: replayed with trajectories other than the ones it was"):
            t.train_step(StepRequest("run", 1, 0, samples))
    assert t.run.policy_version == 1 and all(torch.equal(after[k], v) for k, v in weights(t).items())
    assert t.train_step(StepRequest("run", 1, 0, [])).replayed  # metrics only: nothing to compare

    # The digest is kept in the checkpoint: a trainer resumed from it checks a replay the same way.
    ckpt_dir, _ = t.save_checkpoint("run", str(tmp_path / "step_1"))
    r = Trainer(num_threads=1)
    r.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(RUN_CONFIG),
                resume_checkpoint=str(ckpt_dir))
    assert r.train_step(shuffled).metrics == first.metrics
    with pytest.raises(FailedPrecondition, match="step 1: replayed with trajectories other"):
        r.train_step(StepRequest("run", 1, 0, changed))
    # LoadCheckpoint into a held run restores it too.
    t.train_step(on_policy_step(t, 2))
    t.load_checkpoint("run", str(ckpt_dir))
    with pytest.raises(FailedPrecondition, match="step 1: replayed with trajectories other"):
        t.train_step(StepRequest("run", 1, 0, changed))

    # A checkpoint written before digests were kept: a replay with trajectories cannot be checked, so it is
    # refused; one without trajectories still gets the recorded metrics.
    state_file = ckpt_dir / "lockstep_trainer_state.json"
    state = json.loads(state_file.read_text())
    del state["step_digests"]
    state_file.write_text(json.dumps(state))
    old = Trainer(num_threads=1)
    old.configure(run_id="run", model_path=str(tiny_model_dir), seed=11, config_json=json.dumps(RUN_CONFIG),
                  resume_checkpoint=str(ckpt_dir))
    with pytest.raises(FailedPrecondition, match="step 1: replayed with 6 trajectories, but no digest"):
        old.train_step(shuffled)
    assert old.train_step(StepRequest("run", 1, 0, [])).metrics == first.metrics
    state_file.write_text(json.dumps({**state, "step_digests": {"1": "not-a-digest"}}))
    with pytest.raises(InvalidRequest, match="step_digests: 'not-a-digest' is not a sha256 hex digest"):
        Trainer(num_threads=1).configure(run_id="run", model_path=str(tiny_model_dir), seed=11,
                                         config_json=json.dumps(RUN_CONFIG), resume_checkpoint=str(ckpt_dir))
