"""Seed 000's bug as a test-only attention backend: causal SDPA over the whole
packed buffer, cu_seqlens ignored, so every packed sequence attends to the ones
before it.

`backend(honours_boundaries=...)` builds its registry entry. Declared honestly
(False) the registry refuses it for packed input; mis-declared (True) the
registry cannot know, and only the step-1 parity gate can catch it.
Importing `tests.support.boundary_blind_plugin` registers the mis-declared one
(used as a trainer `attention_plugins` module in end-to-end tests).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention import AttentionBackend, Capability

NAME = "test_boundary_blind"


def boundary_blind(q, k, v, layout, scale, window, deterministic):
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)


def backend(*, honours_boundaries: bool) -> AttentionBackend:
    return AttentionBackend(
        name=NAME, target=f"{__name__}:boundary_blind", priority=1,
        capabilities={"cpu": Capability(honours_boundaries=honours_boundaries,
                                        dtypes=frozenset({torch.float32, torch.float64}),
                                        max_head_dim=512, deterministic=True)},
    )
