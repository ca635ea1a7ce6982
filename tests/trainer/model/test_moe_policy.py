"""A tiny Qwen3-MoE / Qwen2-MoE policy in the trainer: true_on_policy log-probs bitwise the sampler's at every
packing (step-1 IW exactly 1), fp32 masters updated through FSDP2 including every expert and router."""
from __future__ import annotations

import json

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
