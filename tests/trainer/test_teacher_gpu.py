"""On-policy distillation's teacher on one GPU (gpu marker): a sequence's teacher log-probs and argmax are the
same bits alone and packed with others, in bfloat16 on CUDA, through the Triton batch-invariant kernels."""
from __future__ import annotations

import pytest
import torch
from test_teacher import STUDENT, TEACHER, check_alone_equals_batched, restore_attention_policy  # noqa: F401

from recipes.tiny_model import build_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
    pytest.mark.usefixtures("restore_torch_globals"),
]


def test_teacher_log_probs_are_the_same_bits_alone_and_batched_on_gpu_in_bf16(tmp_path):
    student = build_model_dir(tmp_path / "student", STUDENT, seed=3)
    teacher = build_model_dir(tmp_path / "teacher", TEACHER, seed=4)
    check_alone_equals_batched(student, teacher, "bfloat16", device="cuda")
