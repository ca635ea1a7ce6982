"""Routing replay and the rollout's expert ids at the trainer (fast mode, a tiny Qwen3-MoE): replay routes each
token to the rollout's experts (changing what the trainer's router would have chosen), agreement per layer
compares the rollout's choice with the router's own, and ids the model cannot have produced are refused
naming the trajectory, with nothing trained."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kernels.moe.hf_blocks import observe_routing, router_states
from recipes.tiny_moe import TinyMoeConfig, build_moe_model_dir
from services.trainer.data.wire import InvalidRequest, StepRequest
from services.trainer.trainer import Trainer
from trainer_support import current_policy, on_policy_request

CFG = TinyMoeConfig(initializer_range=0.2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_moe_model_dir(tmp_path_factory.mktemp("moe_replay") / "m", CFG, seed=9)


def _trainer(moe_dir, replay: bool) -> Trainer:
    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="r", model_path=str(moe_dir), seed=1, config_json=json.dumps(
        {"dtype": "float32", "microbatch_tokens": 64, "lr": 1e-3, "moe": {"routing_replay": replay},
         # Replay onto other experts moves log-probs far from the (unreplayed) rollout's: a wide gate.
         "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9}}))
    return trainer


def _with_own_experts(trainer, moe_dir, request: StepRequest) -> StepRequest:
    """Each trajectory with the experts the policy's own router picks for every token it reads (the last
    token's row is padding): what a rollout engine with the trainer's numerics would send."""
    model = current_policy(trainer, moe_dir)
    observe_routing(model)
    samples = []
    with torch.no_grad():
        for s in request.samples:
            ids = torch.cat([s.prompt_ids, s.response_ids])
            model(input_ids=ids[None], use_cache=False)
            routed = torch.stack([st.experts for st in router_states(model)], dim=1)  # [P + R, layers, k]
            routed[-1] = -1
            samples.append(dataclasses.replace(s, routed_experts=routed))
    return dataclasses.replace(request, samples=samples)


def test_replay_of_the_routers_own_choice_changes_nothing_and_agrees_everywhere(moe_dir, restore_torch_globals):
    plain = _trainer(moe_dir, replay=False)
    request = _with_own_experts(plain, moe_dir, on_policy_request(plain, moe_dir, 1, n_groups=2, per_group=3, seed=0))
    free = plain.train_step(request).metrics
    replayed = _trainer(moe_dir, replay=True).train_step(request).metrics
    assert replayed["loss"] == free["loss"] and replayed["grad_norm"] == free["grad_norm"]
    for m in (free, replayed):
        assert [m[f"moe_routing_agreement_layer_{i}"] for i in range(CFG.num_hidden_layers)] == [1.0, 1.0]


def test_replay_routes_tokens_to_experts_the_router_would_not_have_chosen(moe_dir, restore_torch_globals):
    plain = _trainer(moe_dir, replay=False)
    request = _with_own_experts(plain, moe_dir, on_policy_request(plain, moe_dir, 1, n_groups=2, per_group=3, seed=0))
    # The rollout "chose" other experts on layer 1: every id moved by one (still distinct, still in range).
    moved = [dataclasses.replace(s, routed_experts=torch.where(
        torch.arange(CFG.num_hidden_layers)[None, :, None] == 1,
        torch.where(s.routed_experts >= 0, (s.routed_experts + 1) % CFG.num_experts, -1), s.routed_experts))
        for s in request.samples]
    request = dataclasses.replace(request, samples=moved)
    free = plain.train_step(request).metrics
    replayer = _trainer(moe_dir, replay=True)
    replayed = replayer.train_step(request).metrics
    assert replayed["loss"] != free["loss"]  # the tokens went through other experts
    for m in (free, replayed):  # agreement measures the rollout against the router's own choice
        assert m["moe_routing_agreement_layer_0"] == 1.0 and m["moe_routing_agreement_layer_1"] < 0.5
    last = router_states(replayer.run.policy.lm)[1]
    assert torch.equal(last.experts, last.forced if last.forced is not None else last.experts)
    assert not torch.equal(last.experts, last.own)  # what ran is not what the router picked


@pytest.mark.parametrize("corrupt, fragment", [
    (lambda r: torch.where(r == r.max(), torch.full_like(r, CFG.num_experts), r), "out of range"),
    (lambda r: r[:, :, :1], r"experts per token"),
    (lambda r: r[:, :1], r"experts per token"),
    (lambda r: torch.cat([r[:-1], r[:1].clamp_min(0)]), "padding but carries an expert id"),
    (lambda r: torch.cat([torch.full_like(r[:1], -1), r[1:]]), "position 0 was read by the model but has no"),
    (lambda r: torch.cat([r[:, :, :1], r[:, :, :1]], dim=-1), "one expert twice"),
    (lambda r: None, "absent, but trainer.moe.routing_replay needs"),
])
def test_impossible_expert_ids_are_refused_naming_the_trajectory_and_nothing_trains(
        moe_dir, corrupt, fragment, restore_torch_globals):
    trainer = _trainer(moe_dir, replay=True)
    request = _with_own_experts(trainer, moe_dir, on_policy_request(trainer, moe_dir, 1, n_groups=1, per_group=3,
                                                                    seed=0))
    before = {k: v.clone() for k, v in trainer.master_state_dict().items()}
    bad = request.samples[1]
    samples = [request.samples[0], dataclasses.replace(bad, routed_experts=corrupt(bad.routed_experts)),
               request.samples[2]]
    with pytest.raises(InvalidRequest, match=rf"trajectory\[1\] \(sample_id '{bad.sample_id}'\)\.routed_experts: .*"
                                             rf"{fragment}"):
        trainer.train_step(dataclasses.replace(request, samples=samples))
    assert trainer.run.policy_version == 0
    assert all(torch.equal(v, trainer.master_state_dict()[k]) for k, v in before.items())
    trainer.train_step(request)  # the honest step trains
    assert trainer.run.policy_version == 1


def test_the_wire_carries_one_byte_per_expert_id_with_255_as_padding():
    from proto import lockstep_pb2 as pb
    from services.common.tensors import ids_to_proto, logprobs_to_proto, to_proto
    from services.trainer.data.wire import decode_trajectory

    routed = torch.tensor([[[1, 2]], [[7, 0]], [[255, 255]]], dtype=torch.uint8)  # 3 tokens, 1 layer, top-2
    header = pb.TrainStepHeader(run_id="r", step=1, policy_version=0, num_trajectories=1)

    def traj(experts):
        return pb.Trajectory(run_id="r", step=1, policy_version=0, group_id="g", sample_id="g/0",
                             prompt_token_ids=ids_to_proto([1, 2]), response_token_ids=ids_to_proto([3]),
                             rollout_logprobs=logprobs_to_proto([-1.0]), routed_experts=to_proto(experts))

    sample = decode_trajectory(traj(routed), 0, header)
    assert sample.routed_experts.tolist() == [[[1, 2]], [[7, 0]], [[-1, -1]]]
    assert routed.element_size() == 1
    with pytest.raises(InvalidRequest, match=r"trajectory\[0\]\.routed_experts: 2 rows for 3 prompt and response"):
        decode_trajectory(traj(routed[:2]), 0, header)
    with pytest.raises(InvalidRequest, match=r"trajectory\[0\]\.routed_experts: dtype torch.float32"):
        decode_trajectory(traj(routed.float()), 0, header)
