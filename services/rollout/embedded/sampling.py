"""The decoder's sampler on a SamplingConfig: kernels.sampling (the stream definition and the kernels) with the
request's options unpacked. Everything else is re-exported so callers keep one import."""
from __future__ import annotations

import torch

from kernels.sampling import (  # noqa: F401 - re-exported
    FMIX_C1,
    FMIX_C2,
    MASK32,
    SEED_SALT,
    TOKEN_MULT,
    fmix32,
    gumbel_argmax_reference,
    row_keys,
    seed_words,
    stream_keys,
    truncate_logits,
    uniforms,
)
from kernels.sampling import sample_tokens as _sample_tokens
from services.rollout.engine import SamplingConfig


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, keys: torch.Tensor) -> torch.Tensor:
    """Next token (int64 [B]) of every row of `logits` [B, V]; row b draws from the stream keyed keys[b]."""
    return _sample_tokens(logits, keys, greedy=sampling.greedy, temperature=sampling.temperature,
                          top_k=sampling.top_k, top_p=sampling.top_p)
