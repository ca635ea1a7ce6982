"""The data-parallel trainer group on 2 GPUs over real NCCL (gpu marker: run on a 2-GPU machine).

bf16 here, so weights are compared between 2-GPU groups (bitwise) but not with one GPU: with bf16
gradients summed in another order, Adam's first step can differ by up to lr where a gradient is
near 0. The fp32 CPU test checks closeness to one process."""
from __future__ import annotations

import json

import pytest
import torch
from test_data_parallel import _steps

from services.trainer.trainer import Trainer
from services.trainer.worker_group import GroupSpec, GroupTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL"),
    pytest.mark.usefixtures("restore_torch_globals"),
]
# bf16: on CUDA the deterministic packed-attention backends (torch_varlen, flash_attn) compute in 16-bit only.
CONFIG = json.dumps({"lr": 1e-2, "microbatch_tokens": 12, "grad_clip": 1.0, "dtype": "bfloat16"})


def _group(model_dir, steps: int):
    group = GroupTrainer(GroupSpec(world_size=2, device="cuda", num_threads=1, timeout_s=120))
    try:
        group.configure(run_id="run", model_path=str(model_dir), seed=5, config_json=CONFIG)
        assert group.info()["details"]["device"] == "cuda:0"
        metrics = _steps(group, steps)
        return metrics, group.replica_digests(), {k: v.cpu().clone() for k, v in group.run.model.state_dict().items()}
    finally:
        group.close()


def test_two_gpus_over_nccl_match_one_gpu_and_themselves(tiny_model_dir):
    single = Trainer(device="cuda:0", num_threads=1)
    single.configure(run_id="run", model_path=str(tiny_model_dir), seed=5, config_json=CONFIG)
    m1 = _steps(single, 1)[0]
    del single
    metrics, digests, w2 = _group(tiny_model_dir, 3)
    assert len(digests) == 2 and digests[0] == digests[1]
    assert {k: v for k, v in metrics[0].items() if k != "grad_norm"} == {k: v for k, v in m1.items() if k != "grad_norm"}
    again, digests_again, _ = _group(tiny_model_dir, 3)
    assert again == metrics and digests_again == digests
