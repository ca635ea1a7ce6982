"""A tiny Qwen3-MoE / Qwen2-MoE policy in the trainer: true_on_policy log-probs bitwise the sampler's at every
packing (step-1 IW exactly 1), fp32 masters updated through FSDP2 including every expert and router."""
from __future__ import annotations

import json
import math

import pytest
import torch

from recipes.tiny_moe import TinyMoeConfig, build_moe_model_dir
from services.trainer.trainer import Trainer
from tests.trainer.test_true_on_policy import TEMPERATURE, _request, check_bitwise_at_every_packing, restore_attention_policy  # noqa: F401
from trainer_support import on_policy_request


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_moe_model_dir(tmp_path_factory.mktemp("tiny_moe") / "m", TinyMoeConfig(initializer_range=0.2),
                               seed=5)


@pytest.fixture(scope="module")
def shared_expert_dir(tmp_path_factory):
    return build_moe_model_dir(tmp_path_factory.mktemp("tiny_moe2") / "m",
                               TinyMoeConfig(family="qwen2_moe", initializer_range=0.2), seed=6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_trainer_logprobs_equal_the_samplers_bits_at_every_packing(moe_dir, dtype, restore_torch_globals):
    check_bitwise_at_every_packing(moe_dir, dtype, n=6)


def test_shared_expert_family_is_bitwise_too(shared_expert_dir, restore_torch_globals):
    check_bitwise_at_every_packing(shared_expert_dir, "bfloat16", n=6)


@pytest.mark.parametrize("numerics", ["fast", "true_on_policy"])
def test_a_step_updates_fp32_masters_of_every_expert_and_router(moe_dir, numerics, restore_torch_globals):
    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="r", model_path=str(moe_dir), seed=1, config_json=json.dumps({
        "numerics": numerics, "dtype": "bfloat16", "microbatch_tokens": 64, "lr": 1e-3,
        "temperature": TEMPERATURE if numerics == "true_on_policy" else 1.0}))
    before = {k: v.clone() for k, v in trainer.master_state_dict().items()}
    assert all(v.dtype == torch.float32 for v in before.values())
    # The step's trajectories as a rollout in the run's numerics would report them (step 1's gate checks them).
    request = (_request(trainer, moe_dir) if numerics == "true_on_policy"
               else on_policy_request(trainer, moe_dir, 1, n_groups=2, per_group=3, seed=0))
    outcome = trainer.train_step(request)
    after = trainer.master_state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for name in before:
        if ".mlp.gate." in name or ".mlp.experts." in name:
            assert name in moved, name
    assert outcome.metrics["grad_norm"] > 0


def _trainer(model_dir, **config):
    trainer = Trainer(device="cpu", num_threads=1)
    trainer.configure(run_id="r", model_path=str(model_dir), seed=1, config_json=json.dumps(
        {"dtype": "float32", "microbatch_tokens": 64, "lr": 1e-3, **config}))
    return trainer


def test_step_metrics_report_expert_load_entropy_and_no_dropped_tokens(moe_dir, restore_torch_globals):
    trainer = _trainer(moe_dir)
    request = on_policy_request(trainer, moe_dir, 1, n_groups=2, per_group=3, seed=0)
    m = trainer.train_step(request).metrics
    positions = sum(s.num_tokens - 1 for s in request.samples)  # packed rows: every token but the last
    cfg = TinyMoeConfig()
    assert m["moe_expert_load_mean"] == positions * cfg.num_experts_per_tok / cfg.num_experts
    assert positions * cfg.num_experts_per_tok / cfg.num_experts < m["moe_expert_load_max"] <= positions
    assert m["moe_dropped_tokens"] == 0.0
    assert 0 < m["moe_router_entropy"] <= math.log(cfg.num_experts) + 1e-6
    assert not any(k.startswith("moe_routing_agreement") for k in m)  # no rollout experts were sent


@pytest.mark.parametrize("loss", ["load_balancing_coef", "router_z_loss_coef"])
def test_auxiliary_router_losses_reach_the_routers_and_nothing_downstream(moe_dir, loss, restore_torch_globals):
    runs = {}
    for coef in (0.0, 0.5):
        trainer = _trainer(moe_dir, grad_clip=0.0, moe={loss: coef})
        request = on_policy_request(trainer, moe_dir, 1, n_groups=2, per_group=3, seed=0)
        runs[coef] = (trainer.train_step(request).metrics, trainer.master_state_dict())
    (plain_m, plain_w), (aux_m, aux_w) = runs[0.0], runs[0.5]
    assert plain_m["loss"] == aux_m["loss"]  # the policy loss itself is the same
    routers = [k for k in plain_w if ".mlp.gate." in k]
    assert routers and all(not torch.equal(plain_w[k], aux_w[k]) for k in routers)
    # The router losses reach what lies upstream of a router (embeddings, attention, earlier layers) and
    # nothing after the last router: its experts, the final norm and the head get only the policy gradient.
    last = TinyMoeConfig().num_hidden_layers - 1
    downstream = [k for k in plain_w if k.startswith(("lm_head.", "model.norm.", f"model.layers.{last}.mlp.experts."))]
    assert len(downstream) == 4 and all(torch.equal(plain_w[k], aux_w[k]) for k in downstream)
    assert not torch.equal(plain_w["model.embed_tokens.weight"], aux_w["model.embed_tokens.weight"])


def test_moe_options_on_a_dense_model_are_refused_naming_the_field(tiny_model_dir, restore_torch_globals):
    from services.trainer.data.wire import InvalidRequest

    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.moe\.router_z_loss_coef: .*'qwen3'"):
        _trainer(tiny_model_dir, moe={"router_z_loss_coef": 0.01})


def test_step_metrics_from_microbatch_stats():
    from services.trainer.model.moe import moe_step_metrics

    # Two layers, three experts; columns: counts, entropy sum, tokens, agreeing, carried.
    first = torch.tensor([[4.0, 2.0, 0.0, 3.0, 3.0, 2.0, 3.0], [1.0, 1.0, 4.0, 1.5, 3.0, 3.0, 3.0]], dtype=torch.float64)
    second = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]], dtype=torch.float64)
    m = moe_step_metrics([first, second])
    assert m["moe_expert_load_max"] == 4.0 and m["moe_expert_load_mean"] == 16.0 / 6
    assert m["moe_router_entropy"] == 6.0 / 8
    assert m["moe_routing_agreement_layer_0"] == 0.5 and m["moe_routing_agreement_layer_1"] == 1.0
    assert m["moe_routing_agreement_min"] == 0.5 and m["moe_dropped_tokens"] == 0.0


def test_lora_covers_attention_and_refuses_adapters_inside_moe_blocks(moe_dir, shared_expert_dir,
                                                                      restore_torch_globals):
    from services.trainer.data.wire import InvalidRequest

    # all-linear reaches into the MoE blocks (peft wraps the experts' 3-D parameters, and Qwen2-MoE's shared
    # expert is linear layers): refused, naming the module.
    for model_dir, module in ((moe_dir, r"model\.layers\.0\.mlp\.experts"),
                              (shared_expert_dir, r"model\.layers\.0\.mlp\.")):
        with pytest.raises(InvalidRequest, match=r"trainer_config_json\.lora\.target_modules: an adapter on "
                                                 + module):
            _trainer(model_dir, lora={"rank": 4, "alpha": 8.0})
    for model_dir in (moe_dir, shared_expert_dir):
        trainer = _trainer(model_dir, lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "o_proj"]})
        adapted = [n for n, m in trainer.run.policy.lm.named_modules() if n.endswith(".lora_A.default")]
        assert len(adapted) == 3 * 2 and not any(".mlp." in n for n in adapted)
        trainable = [n for n, p in trainer.run.policy.lm.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in n for n in trainable)


def test_an_moe_checkpoint_is_hugging_face_layout_and_resumes_bitwise(moe_dir, tmp_path, restore_torch_globals):
    from transformers import AutoModelForCausalLM

    first = _trainer(moe_dir, moe={"routing_replay": False})
    first.train_step(on_policy_request(first, moe_dir, 1, n_groups=2, per_group=3, seed=0))
    path, _ = first.save_checkpoint("r", str(tmp_path / "ckpt"))
    loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)  # the family's own layout
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM"
    assert torch.equal(loaded.model.layers[1].mlp.experts.gate_up_proj,
                       first.master_state_dict()["model.layers.1.mlp.experts.gate_up_proj"])
    step2 = on_policy_request(first, moe_dir, 2, n_groups=2, per_group=3, seed=0)
    want = first.train_step(step2).metrics
    resumed = Trainer(device="cpu", num_threads=1)
    resumed.configure(run_id="r", model_path=str(moe_dir), seed=1, resume_checkpoint=str(path),
                      config_json=json.dumps({"dtype": "float32", "microbatch_tokens": 64, "lr": 1e-3,
                                              "moe": {"routing_replay": False}}))
    assert resumed.train_step(step2).metrics == want
    a, b = first.master_state_dict(), resumed.master_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
