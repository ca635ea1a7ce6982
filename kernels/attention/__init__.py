"""Packed causal self-attention: contract, registry of backends, Hugging Face hook.

Public API (see contract.py for the layout and semantics):

    packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, *, scale=None, window=None, position_ids=None)
    REGISTRY.select(...), REGISTRY.forced(name), REGISTRY.set_policy(AttentionPolicy(...)),
    REGISTRY.usage() / REGISTRY.reset_usage()
    register_hf_attention() -> "lockstep_packed";  packed_forward_kwargs(position_ids, cu_seqlens, max_seqlen)

Backends (lazily imported): flash_attn, torch_varlen, flex, reference.
"""
from kernels.attention.contract import (
    AttentionBackendError,
    AttentionContractError,
    AttentionError,
    Capability,
    PackedLayout,
    platform_of,
)
from kernels.attention.hf import HF_ATTN_IMPLEMENTATION, packed_forward_kwargs, register_hf_attention
from kernels.attention.registry import (
    REGISTRY,
    AttentionBackend,
    AttentionPolicy,
    AttentionRegistry,
    packed_causal_attention,
)

__all__ = [
    "REGISTRY",
    "HF_ATTN_IMPLEMENTATION",
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionContractError",
    "AttentionError",
    "AttentionPolicy",
    "AttentionRegistry",
    "Capability",
    "PackedLayout",
    "packed_causal_attention",
    "packed_forward_kwargs",
    "platform_of",
    "register_hf_attention",
]
