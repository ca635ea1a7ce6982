"""numerics 'true_on_policy' on one GPU (gpu marker): the CPU test's sampler/trainer bitwise check in bfloat16 on
CUDA, at a small random Qwen3 shape, through the Triton batch-invariant kernels."""
from __future__ import annotations

import pytest
import torch
from test_true_on_policy import check_bitwise_at_every_packing, restore_attention_policy  # noqa: F401 (autouse)

from recipes.tiny_model import TinyQwen3Config, build_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
    pytest.mark.usefixtures("restore_torch_globals"),
]

SHAPE = TinyQwen3Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, intermediate_size=768, max_position_embeddings=128, initializer_range=0.1)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("bi_gpu") / "m", SHAPE, seed=11)


def test_trainer_logprobs_equal_the_samplers_bits_on_gpu_in_bf16(gpu_model_dir):
    check_bitwise_at_every_packing(gpu_model_dir, "bfloat16", device="cuda", n=24)
