"""Multi-turn samples in the trainer: environment tokens are context, never a loss, IW or parity term.

A multi-turn response interleaves the model's tokens (mask True) with environment observations (mask
False); rollout log-probs come for the model's tokens only. What must hold:
- the wire refuses a mask that disagrees with the response or the log-probs, naming the field;
- both layouts (packed and padded) put exactly the model tokens in the loss, each with its own log-prob;
- the gradient does not depend on anything attached to an environment position (its target, rollout
  log-prob or advantage): changing them leaves every parameter's gradient the same bits, while marking
  the same tokens as the model's changes it;
- in true_on_policy, a 3-turn episode's model tokens are scored by the trainer with exactly the bits the
  sampler reported, across turns, and the step-1 IW is exactly 1 over them.
"""
from __future__ import annotations

import json

import pytest
import torch

from kernels.attention import REGISTRY
from proto import lockstep_pb2 as pb
from recipes.tiny_model import build_model_dir
from services.common.tensors import to_proto
from services.trainer.data.batching import TrainSample, collate_padded
from services.trainer.data.packing import PackSample, pack_samples
from services.trainer.data.wire import InvalidRequest, StepRequest, decode_trajectory
from services.trainer.loss.policy_loss import StepShape, microbatch_loss, step_shape
from services.trainer.trainer import Trainer
from test_true_on_policy import SMALL, TEMPERATURE, _rollout_model, sample_full_recompute


@pytest.fixture(autouse=True)
def restore_attention_policy():
    saved = REGISTRY.policy
    yield
    REGISTRY.set_policy(saved)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny_mt") / "m", SMALL, seed=5)


# ---------------------------------------------------------------- wire

def _trajectory(response, mask, logprobs) -> pb.Trajectory:
    msg = pb.Trajectory(run_id="r", step=1, policy_version=0, group_id="g", sample_id="g/0",
                        prompt_token_ids=to_proto(torch.tensor([5, 6], dtype=torch.int32)),
                        response_token_ids=to_proto(torch.tensor(response, dtype=torch.int32)),
                        rollout_logprobs=to_proto(torch.tensor(logprobs, dtype=torch.float32)), reward=1.0,
                        advantage=0.5)
    if mask is not None:
        msg.response_mask.CopyFrom(to_proto(torch.tensor(mask, dtype=torch.bool)))
    return msg


HEADER = pb.TrainStepHeader(run_id="r", step=1, policy_version=0, num_trajectories=1)


def test_the_wire_carries_a_mask_and_the_model_tokens_log_probs_only():
    sample = decode_trajectory(_trajectory([7, 8, 9, 10], [True, False, False, True], [-0.5, -0.25]), 0, HEADER)
    assert sample.response_mask.tolist() == [True, False, False, True]
    assert sample.rollout_logprobs.tolist() == [-0.5, -0.25] and sample.num_model_tokens == 2
    # Without a mask every response token is the model's, as before.
    plain = decode_trajectory(_trajectory([7, 8], None, [-0.5, -0.25]), 0, HEADER)
    assert plain.response_mask is None and plain.num_model_tokens == 2


@pytest.mark.parametrize("response,mask,logprobs,message", [
    ([7, 8, 9], [True, False], [-0.5], "trajectory[0].response_mask: 2 values for 3 response tokens"),
    ([7, 8], [False, False], [], "trajectory[0].response_mask: no model token"),
    ([7, 8, 9], [True, False, True], [-0.5, -0.1, -0.2], "trajectory[0].rollout_logprobs: 3 values for 2 model"),
    ([7, 8, 9], [True, False, True], [-0.5], "trajectory[0].rollout_logprobs: 1 values for 2 model"),
])
def test_a_mask_that_disagrees_is_refused_naming_the_field(response, mask, logprobs, message):
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        decode_trajectory(_trajectory(response, mask, logprobs), 0, HEADER)


def test_token_versions_count_the_model_tokens_of_an_episode():
    # A replica reports a version for each token it sampled: the model tokens, not the observations.
    msg = _trajectory([7, 8, 9, 10], [True, False, False, True], [-0.5, -0.25])
    msg.token_policy_versions.extend([0, 0])
    assert decode_trajectory(msg, 0, HEADER).num_model_tokens == 2
    del msg.token_policy_versions[:]
    msg.token_policy_versions.extend([0, 0, 0, 0])
    with pytest.raises(InvalidRequest, match=r"token_policy_versions: 4 versions for 2 model tokens \(step 1\)"):
        decode_trajectory(msg, 0, HEADER)


def test_a_mask_of_another_dtype_is_refused():
    msg = _trajectory([7, 8], None, [-0.5, -0.25])
    msg.response_mask.CopyFrom(to_proto(torch.tensor([1, 1], dtype=torch.int32)))
    with pytest.raises(InvalidRequest, match=r"trajectory\[0\].response_mask"):
        decode_trajectory(msg, 0, HEADER)


# ---------------------------------------------------------------- layouts

def test_both_layouts_score_exactly_the_model_tokens():
    # prompt [5, 6]; response: model 7 8, environment 20 21 22, model 9.
    mask = [True, True, False, False, False, True]
    sample = TrainSample("g/0", "g", torch.tensor([5, 6]), torch.tensor([7, 8, 20, 21, 22, 9]),
                         torch.tensor([-0.1, -0.2, -0.3]), 1.0, 0.5, torch.tensor(mask))
    other = TrainSample("g/1", "g", torch.tensor([4]), torch.tensor([11, 12]), torch.tensor([-0.4, -0.5]), 0.0, -0.5)
    packed = pack_samples([PackSample([5, 6], [7, 8, 20, 21, 22, 9], [-0.1, -0.2, -0.3], 0.5, "g/0", mask),
                           PackSample([4], [11, 12], [-0.4, -0.5], -0.5, "g/1")])
    padded = collate_padded([sample, other])
    for mb in (packed[0], padded):
        assert mb.response_targets.tolist() == [7, 8, 9, 11, 12]
        assert mb.response_rollout_logprobs.tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
        assert mb.response_advantages.tolist() == [0.5] * 3 + [-0.5] * 2
        assert mb.response_positions.tolist() == [2, 3, 7, 1, 2]
        assert mb.response_ranks.tolist() == [0, 1, 2, 0, 1]
    assert step_shape([sample, other]).sequence_lengths.tolist() == [3, 2]


def test_packing_refuses_a_mask_that_disagrees():
    with pytest.raises(ValueError, match="sample 0: 2 rollout log-probs for 1 model tokens"):
        pack_samples([PackSample([5], [7, 8], [-0.1, -0.2], 0.5, "a", [True, False])])
    with pytest.raises(ValueError, match="sample 0: no model token"):
        pack_samples([PackSample([5], [7, 8], [], 0.5, "a", [False, False])])


# ---------------------------------------------------------------- gradient

def _episode_samples(vocab: int) -> list[PackSample]:
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(3):
        turns = [torch.randint(3, vocab, (3 + i,), generator=g).tolist() for _ in range(3)]
        obs = [torch.randint(3, vocab, (2,), generator=g).tolist() for _ in range(2)]
        response = turns[0] + obs[0] + turns[1] + obs[1] + turns[2]
        mask = [True] * len(turns[0]) + [False] * 2 + [True] * len(turns[1]) + [False] * 2 + [True] * len(turns[2])
        model = sum(mask)
        logprobs = (-0.1 - 0.05 * torch.arange(model, dtype=torch.float32)).tolist()
        out.append(PackSample([3 + i, 4], response, logprobs, 0.7 - 0.6 * i, f"g/{i}", mask))
    return out


def _gradients(trainer: Trainer, mb) -> list[torch.Tensor]:
    run = trainer.run
    params = [p for p in run.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    logp, _, _ = run.policy(mb, temperature=run.config.temperature)
    # The step's loss tokens per sequence, from the unchanged microbatch (a step-wide constant).
    shape = StepShape(sequence_lengths=torch.tensor([3 * 3 + 3 * i for i in range(mb.num_sequences)]))
    part = microbatch_loss(run.config, logp, mb.response_rollout_logprobs, mb.response_advantages,
                           mb.response_sample_index, shape)
    part.loss.backward()
    return [p.grad.detach().clone() for p in params]


def test_environment_positions_never_reach_the_gradient(model_dir, restore_torch_globals):
    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="grad", model_path=str(model_dir), seed=7,
                      config_json=json.dumps({"dtype": "float32", "microbatch_tokens": 4096}))
    vocab = int(trainer.run.vocab_size)
    samples = _episode_samples(vocab)
    (mb,) = pack_samples(samples)
    base = _gradients(trainer, mb)
    assert any(bool(g.abs().sum() > 0) for g in base)
    # Every row that predicts an environment token: another target, rollout log-prob and advantage.
    env_rows = torch.zeros_like(mb.loss_mask)
    for i, s in enumerate(samples):
        start = int(mb.cu_seqlens[i])
        rows = torch.arange(start + len(s.prompt_ids) - 1, start + len(s.prompt_ids) - 1 + len(s.response_ids))
        env_rows[rows[~torch.tensor(s.response_mask)]] = True
    assert int(env_rows.sum()) == 12
    changed = type(mb)(**{**mb.__dict__,
                          "targets": torch.where(env_rows, (mb.targets + 5) % vocab, mb.targets),
                          "rollout_logprobs": torch.where(env_rows, torch.full_like(mb.rollout_logprobs, -7.0),
                                                          mb.rollout_logprobs),
                          "advantages": torch.where(env_rows, torch.full_like(mb.advantages, 3.0), mb.advantages)})
    for a, b in zip(base, _gradients(trainer, changed)):
        assert torch.equal(a, b)
    # The test can fail: the same changes on positions that are in the loss move the gradient.
    leaky = type(mb)(**{**changed.__dict__, "loss_mask": changed.loss_mask | env_rows})
    assert any(not torch.equal(a, b) for a, b in zip(base, _gradients(trainer, leaky)))


# ---------------------------------------------------------------- true_on_policy across turns

def test_three_turn_episodes_are_scored_with_the_samplers_bits(model_dir, restore_torch_globals):
    """Each turn is sampled after the whole context so far (earlier turns and observations), the way an
    episode runs; the trainer scores every model token with the same bits, so the step-1 IW is 1."""
    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="mt", model_path=str(model_dir), seed=7, config_json=json.dumps({
        "numerics": "true_on_policy", "dtype": "float32", "microbatch_tokens": 4096, "temperature": TEMPERATURE}))
    model = _rollout_model(trainer, model_dir)
    vocab = int(trainer.run.vocab_size)
    g = torch.Generator().manual_seed(2)
    samples = []
    for i in range(4):
        prompt = torch.randint(3, vocab, (2 + i,), generator=g).tolist()
        context, response, mask, logps = list(prompt), [], [], []
        for turn in range(3):
            (tokens,), (lp,) = sample_full_recompute(model, [context], [2 + (i + turn) % 3], seed=100 * i + turn)
            context += tokens
            response += tokens
            mask += [True] * len(tokens)
            logps += lp
            if turn < 2:
                observation = torch.randint(3, vocab, (3,), generator=g).tolist()
                context += observation
                response += observation
                mask += [False] * len(observation)
        samples.append(TrainSample(f"g{i // 2}/{i % 2}", f"g{i // 2}", torch.tensor(prompt), torch.tensor(response),
                                   torch.tensor(logps, dtype=torch.float32), float(i % 2), float(i % 2) - 0.5,
                                   torch.tensor(mask)))
    model_tokens = sum(s.num_model_tokens for s in samples)
    verdict = trainer.check_parity(StepRequest("mt", 1, 0, samples))
    assert verdict.passed, verdict.message()
    assert verdict.stats["logprob_abs_diff_max"] == 0.0 and verdict.stats["tokens"] == model_tokens
    m = trainer.train_step(StepRequest("mt", 1, 0, samples)).metrics
    assert m["iw_min"] == m["iw_max"] == 1.0 and m["logprob_abs_diff_max"] == 0.0 and m["grad_norm"] > 0
