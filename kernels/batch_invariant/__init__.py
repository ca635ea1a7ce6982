"""Batch-invariant forwards: a row's output bits do not depend on the other rows of the call.

    from kernels.batch_invariant import KEY_BLOCK, bi_linear, bi_rms_norm, packed_attention, decode_attention

Each op dispatches by device (CUDA/ROCm -> Triton kernels with fixed tiles, CPU -> pure torch)
and reduces in an order that never depends on the number of rows; packed_attention and
decode_attention reduce keys in KEY_BLOCK blocks aligned to each sequence's first key, so a
token's attention output is the same bits in packed prefill and in KV-cache decode, dense or paged
(paged.py: a page is one key block).
"""
from kernels.batch_invariant.ops import (
    BatchInvariantInputError,
    bi_linear,
    bi_rms_norm,
    decode_attention,
    packed_attention,
)
from kernels.batch_invariant.paged import paged_decode_attention, paged_prefill_attention
from kernels.batch_invariant.reference import KEY_BLOCK

__all__ = [
    "KEY_BLOCK",
    "BatchInvariantInputError",
    "bi_linear",
    "bi_rms_norm",
    "decode_attention",
    "packed_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
]
