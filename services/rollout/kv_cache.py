"""The decoder's static KV cache and the Hugging Face attention function that fills and reads it.

The cache holds, per layer, K and V as [rows, Hkv, capacity, D] tensors
allocated once; row b of a batch keeps its tokens at positions 0..len-1. The
model runs with `use_cache=False`: HF computes q/k/v (after RoPE) and hands
them to `decoder_attention_forward`, which receives the cache and the step's
layout through the `lockstep_kv` forward kwarg (HF passes unknown forward
kwargs down to the attention function), writes the new K/V into the cache and
attends:

- prefill (`KVStep.prefill`): one packed [1, T] buffer of whole prompts
  (cu_seqlens, no padding); token i of sequence s goes to cache row s at
  position i; attention is packed causal attention over the buffer.
- decode (`KVStep.decode`): [B, 1], one new token per row at position
  lengths[b] - 1; attention is `decode_attention` over cache row b's keys
  [0, lengths[b]).

No mask is ever built: the implementation registers no function in
transformers' AttentionMaskInterface, and create_causal_mask returns None for
an implementation without one (transformers 5.x), before it looks at the
inputs (so nothing syncs with the host and a decode step can be captured in a
CUDA graph). A mask passed anyway is refused.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

DECODER_ATTN_IMPLEMENTATION = "lockstep_decoder"

PackedAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
"""(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [S+1], max_seqlen, scale) -> [T, H, D]."""
DecodeAttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(q [B, H, D], k_cache [B, Hkv, L, D], v_cache [B, Hkv, L, D], lengths int32 [B], scale) -> [B, H, D]."""


class StaticKVCache:
    """Per-layer K/V of `rows` sequences, `capacity` positions each; zero-filled once, rewritten in place."""

    def __init__(self, *, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (rows, kv_heads, capacity, head_dim)
        self.rows, self.capacity = rows, capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def fits(self, rows: int, capacity: int) -> bool:
        return rows <= self.rows and capacity <= self.capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


@dataclass(frozen=True)
class KVStep:
    """What one forward of the model does with the cache (passed as the `lockstep_kv` forward kwarg)."""

    cache: StaticKVCache
    rows: torch.Tensor
    """int64 [N]: cache row of each new token (prefill: its sequence; decode: 0..B-1)."""
    positions: torch.Tensor
    """int64 [N]: cache position each new token's K/V is written to."""
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    """(q [N, H, D], k, v, scale) -> [N, H, D]; k/v are the layer's cache rows (decode) or the buffer's own."""
    decode: bool

    @classmethod
    def prefill(cls, cache: StaticKVCache, rows: torch.Tensor, positions: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, packed_attention: PackedAttentionFn) -> "KVStep":
        """Packed prompts: attention runs over the buffer's own K/V, causal within each sequence."""

        def attend(q, k, v, scale):
            return packed_attention(q, k, v, cu_seqlens, max_seqlen, scale)

        return cls(cache, rows, positions, attend, decode=False)

    @classmethod
    def decode_step(cls, cache: StaticKVCache, positions: torch.Tensor, lengths: torch.Tensor,
                    decode_attention: DecodeAttentionFn) -> "KVStep":
        """One token per row; `positions` int64 [B] = lengths - 1 (both static buffers when graph-captured)."""
        rows = torch.arange(positions.shape[0], dtype=torch.int64, device=positions.device)

        def attend(q, k_cache, v_cache, scale):
            return decode_attention(q, k_cache, v_cache, lengths, scale)

        return cls(cache, rows, positions, attend, decode=True)


@contextlib.contextmanager
def _unique_index_writes() -> Iterator[None]:
    """Deterministic algorithms off around a cache write: every (row, position) index is unique, so the plain
    index_put_ kernel is deterministic, and its sort-based deterministic variant need not be graph-capturable."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if enabled:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        if enabled:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)


def register_decoder_attention() -> str:
    """Register `decoder_attention_forward` with transformers' AttentionInterface (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(DECODER_ATTN_IMPLEMENTATION, decoder_attention_forward)
    return DECODER_ATTN_IMPLEMENTATION


def decoder_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    lockstep_kv: KVStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: q [B, H, S, D], k/v [B, Hkv, S, D] (after RoPE) in, [B, S, H, D] out."""
    impl = DECODER_ATTN_IMPLEMENTATION
    if lockstep_kv is None:
        raise RuntimeError(f"{impl}: called without the lockstep_kv forward kwarg; this attention only runs "
                           "inside services.rollout.decoder (it needs the static KV cache)")
    if attention_mask is not None:
        raise RuntimeError(f"{impl}: got an attention mask; the decoder carries boundaries in its KV layout")
    if dropout or sliding_window is not None or kwargs.get("output_attentions"):
        raise RuntimeError(f"{impl}: dropout, sliding windows and attention outputs are not supported")
    batch, heads, seqlen, head_dim = query.shape
    layer = module.layer_idx
    k_cache, v_cache = lockstep_kv.cache.keys[layer], lockstep_kv.cache.values[layer]
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    if lockstep_kv.decode:
        if seqlen != 1:
            raise RuntimeError(f"{impl}: a decode step feeds one token per row, got {seqlen}")
        new_k, new_v, q = key[:, :, 0], value[:, :, 0], query[:, :, 0]  # [B, Hkv, D], [B, H, D]
    else:
        if batch != 1:
            raise RuntimeError(f"{impl}: prefill is one packed [1, T] buffer, got batch {batch}")
        new_k, new_v, q = key[0].transpose(0, 1), value[0].transpose(0, 1), query[0].transpose(0, 1)  # [T, *, D]
    with _unique_index_writes():
        k_cache[lockstep_kv.rows, :, lockstep_kv.positions] = new_k
        v_cache[lockstep_kv.rows, :, lockstep_kv.positions] = new_v
    if lockstep_kv.decode:
        out = lockstep_kv.attend(q.contiguous(), k_cache[:batch], v_cache[:batch], scale)
        return out.unsqueeze(1), None  # [B, 1, H, D]
    out = lockstep_kv.attend(q.contiguous(), new_k.contiguous(), new_v.contiguous(), scale)
    return out.unsqueeze(0), None  # [1, T, H, D]
