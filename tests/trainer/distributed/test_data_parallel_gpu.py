"""The FSDP2 trainer on 2 GPUs over real NCCL (gpu marker: run on a 2-GPU machine).

bf16 compute over float32 masters. Against one GPU on the same step: the metrics are bitwise
equal except grad_norm (every microbatch's forward runs on the same bf16 cast of the same
masters); two 2-GPU groups agree bit for bit over 3 steps."""
from __future__ import annotations

import os

import pytest
import torch
from test_data_parallel import CONFIG, _configure, _steps

from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer
from services.trainer.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL"),
    pytest.mark.usefixtures("restore_torch_globals"),
]
# bf16: on CUDA the deterministic packed-attention backends (torch_varlen, flash_attn) compute in 16-bit only.
GPU_CONFIG = {**CONFIG, "dtype": "bfloat16"}
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts


def _group(model_dir, steps: int):
    group = GroupTrainer(GroupSpec(world_size=2, device="cuda", num_threads=1, timeout_s=120))
    try:
        _configure(group, model_dir, GPU_CONFIG)
        assert group.info()["details"]["device"] == "cuda:0"
        return _steps(group, model_dir, 1, steps), group.weights_digest()
    finally:
        group.close()


def test_two_gpus_over_nccl_match_one_gpu_and_themselves(tiny_model_dir):
    single = _configure(Trainer(device="cuda:0", num_threads=1), tiny_model_dir, GPU_CONFIG)
    m1 = _steps(single, tiny_model_dir, 1, 1)[0]
    del single
    metrics, digest = _group(tiny_model_dir, 3)
    assert {k: v for k, v in metrics[0].items() if k != "grad_norm"} == {k: v for k, v in m1.items() if k != "grad_norm"}
    again, digest_again = _group(tiny_model_dir, 3)
    assert again == metrics and digest_again == digest
