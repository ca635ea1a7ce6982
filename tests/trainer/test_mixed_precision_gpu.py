"""float32 masters with bf16 compute on one GPU (gpu marker): the CPU checks of test_mixed_precision on CUDA,
where FSDP2 runs over a one-rank NCCL group."""
from __future__ import annotations

import pytest
import torch
from test_mixed_precision import (
    test_an_lr_1e6_step_moves_every_master_weight_with_a_gradient as _moves,
    test_compiled_layers_train_like_eager_and_rerun_bitwise as _compiled,
    test_rollout_gets_the_bf16_cast_of_the_masters as _cast,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
    pytest.mark.usefixtures("restore_torch_globals"),
]


def test_an_lr_1e6_step_moves_the_masters_on_gpu(tiny_model_dir):
    _moves(tiny_model_dir, device="cuda")


def test_rollout_gets_the_bf16_cast_on_gpu(tiny_model_dir, tmp_path):
    _cast(tiny_model_dir, tmp_path, device="cuda")


def test_compiled_bf16_layers_on_gpu(tiny_model_dir):
    _compiled(tiny_model_dir, device="cuda", dtype="bfloat16")
