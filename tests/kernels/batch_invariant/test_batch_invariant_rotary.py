"""Rotary embedding is row-invariant as HF computes it (CPU; the GPU check is in test_batch_invariant_gpu.py).

The batch-invariant mode patches matmuls, norms and attention but leaves HF's rotary embedding
alone; this is the proof that it needs no patch.
"""
from __future__ import annotations

from tests.kernels.batch_invariant.batch_invariant_support import check_rotary_row_invariance


def test_hf_rotary_embedding_is_row_invariant_on_cpu():
    check_rotary_row_invariance("cpu")
