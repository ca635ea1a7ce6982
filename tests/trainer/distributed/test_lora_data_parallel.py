"""A LoRA policy on the multi-rank (FSDP2, gloo) trainer: frozen base and trainable adapters share each
decoder layer's FSDP unit. The same guarantees as a full policy: a step's metrics other than grad_norm are
bitwise those of one process, the adapters after it equal to rounding, and the group's adapter checkpoint
resumes in one process on the same weights."""
from __future__ import annotations

import json

import pytest
import torch
from trainer_support import make_episodes, rollout_logprobs

from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")
CONFIG = {"lr": 1e-2, "microbatch_tokens": 12, "grad_clip": 1.0,
          "lora": {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}}


def step_request(trainer, model_dir, step: int) -> StepRequest:
    """Trajectories scored as an embedded rollout engine synced to the trainer's adapters reports them."""
    snapshot = trainer.weight_tensors("run")
    engine = TorchEngine(TorchEngineConfig(dtype="float32"))
    engine.load(str(model_dir), 0)
    if step > 1:
        engine.update_lora_adapter(snapshot.lora, dict(snapshot.tensors), step - 1)
    model = engine._require_model()
    eps = make_episodes(n_groups=3, per_group=3, seed=10 + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                           torch.tensor(rollout_logprobs(model, e["prompt"], e["response"])), e["reward"], a)
               for e, a in zip(eps, adv)]
    return StepRequest("run", step, step - 1, samples)


def _configure(trainer, model_dir, resume: str = ""):
    trainer.configure(run_id="run", model_path=str(model_dir), seed=5, config_json=json.dumps(CONFIG),
                      resume_checkpoint=resume)
    return trainer


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.master_state_dict().items() if ".lora_" in k}


def without_grad_norm(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "grad_norm"}


def test_two_ranks_train_lora_like_one_process_and_resume_it(tiny_model_dir, tmp_path):
    single = _configure(Trainer(num_threads=1), tiny_model_dir)
    first = single.train_step(step_request(single, tiny_model_dir, 1)).metrics
    single_adapters = _adapters(single)

    group = GroupTrainer(GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=120))
    try:
        _configure(group, tiny_model_dir)
        step1 = group.train_step(step_request(group, tiny_model_dir, 1)).metrics
        assert without_grad_norm(step1) == without_grad_norm(first)
        assert abs(step1["iw_mean"] - 1) <= 1e-5 and step1["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-5)
        group_adapters = _adapters(group)
        assert group_adapters.keys() == single_adapters.keys() and len(group_adapters) == 28
        for k, v in single_adapters.items():
            torch.testing.assert_close(group_adapters[k], v, rtol=1e-5, atol=1e-6)
        # Only adapters cross a sync from a group too: rank 0 streams the gathered adapters.
        snapshot = group.weight_tensors("run")
        assert snapshot.lora is not None and len(snapshot.tensors) == 28

        group.train_step(step_request(group, tiny_model_dir, 2))
        path, version = group.save_checkpoint("run", str(tmp_path / "step_2"))
        assert version == 2 and (path / "adapter_model.safetensors").is_file()
        request3 = step_request(group, tiny_model_dir, 3)
        step3 = group.train_step(request3).metrics
        assert abs(step3["iw_mean"] - 1) <= 1e-5  # the rollout's merged adapters are the trainer's policy
    finally:
        group.close()
    resumed = _configure(Trainer(num_threads=1), tiny_model_dir, resume=str(path))
    assert resumed.run.policy_version == 2
    assert without_grad_norm(resumed.train_step(request3).metrics) == without_grad_norm(step3)
