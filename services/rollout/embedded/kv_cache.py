"""The decoder's paged KV pool and the Hugging Face attention function that fills and reads it.

The pool holds, per layer, K and V as [pages, Hkv, KEY_BLOCK, D] tensors allocated once. A page is exactly one
key block of the batch-invariant attention (kernels.batch_invariant.KEY_BLOCK), so a sequence's keys are
reduced in the same blocks whatever pages hold them. A sequence's block table lists its pages in position
order: position p lives in slot p % KEY_BLOCK of page table[p // KEY_BLOCK]. Page 0 is scratch: padded rows of
a captured decode step write there and it is never handed to a sequence.

The model runs with `use_cache=False`: HF computes q/k/v (after RoPE) and hands them to
`decoder_attention_forward`, which receives the pool and the step's layout through the `lockstep_kv` forward
kwarg (HF passes unknown forward kwargs down to the attention function), writes the new K/V into their slots
and attends:

- prefill (`KVStep.prefill`): one packed [1, T] buffer holding the next chunk of tokens of several sequences
  (cu_seqlens, no padding); attention is causal over each sequence's keys in the pool, the earlier chunks'
  and this one's (or, in fast mode when every chunk starts a sequence, the packed kernel over the buffer).
- decode (`KVStep.decode_step`): [B, 1], one new token per row at position lengths[b] - 1, attending its
  keys [0, lengths[b]) through its block table.

No mask is ever built: the implementation registers no function in transformers' AttentionMaskInterface,
and create_causal_mask returns None for an implementation without one (transformers 5.x), before it looks at
the inputs (so nothing syncs with the host and a decode step can be captured in a CUDA graph). A mask passed
anyway is refused.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.batch_invariant import KEY_BLOCK
from kernels.batch_invariant.fused import unique_index_writes

DECODER_ATTN_IMPLEMENTATION = "lockstep_decoder"
PAGE_TOKENS = KEY_BLOCK
"""Tokens per page: one key block of the batch-invariant attention."""
SCRATCH_PAGE = 0

AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
"""(q [N, H, D], new_k [N, Hkv, D], new_v, k_pool, v_pool, scale) -> [N, H, D], after the new K/V are written."""


class PagedKVPool:
    """Per-layer K/V pages, zero-filled once and rewritten in place (one allocation for all layers)."""

    def __init__(self, *, layers: int, pages: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if pages < 2:
            raise ValueError(f"a KV pool needs at least 2 pages (one is scratch), got {pages}")
        self.pages = pages
        self._storage = torch.zeros((layers, 2, pages, kv_heads, PAGE_TOKENS, head_dim), dtype=dtype, device=device)
        self.keys = [self._storage[i, 0] for i in range(layers)]
        self.values = [self._storage[i, 1] for i in range(layers)]

    @staticmethod
    def page_bytes(*, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return layers * 2 * kv_heads * PAGE_TOKENS * head_dim * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()

    def copy_pages_from(self, other: "PagedKVPool") -> None:
        """Every page of a smaller pool of the same shape into the same pages here (a grown pool)."""
        self._storage[:, :, :other.pages].copy_(other._storage)

    def copy_page(self, src: int, dst: int) -> None:
        """Every layer's K and V of page `src` into page `dst` (copy on write of a shared page): the same bits."""
        self._storage[:, :, dst].copy_(self._storage[:, :, src])


@dataclass(frozen=True)
class KVStep:
    """What one forward of the model does with the pool (passed as the `lockstep_kv` forward kwarg)."""

    pool: PagedKVPool
    pages: torch.Tensor
    """int64 [N]: the page each new token's K/V is written to."""
    slots: torch.Tensor
    """int64 [N]: the slot within that page."""
    attend: AttendFn
    decode: bool

    @classmethod
    def prefill(cls, pool: PagedKVPool, pages: torch.Tensor, slots: torch.Tensor, attend: AttendFn) -> "KVStep":
        return cls(pool, pages, slots, attend, decode=False)

    @classmethod
    def decode_step(cls, pool: PagedKVPool, positions: torch.Tensor, block_tables: torch.Tensor,
                    attend: AttendFn) -> "KVStep":
        """One token per row at `positions` int64 [B]; its page is looked up on the device (graph-capturable)."""
        pages = block_tables.gather(1, (positions // PAGE_TOKENS)[:, None])[:, 0].long()
        return cls(pool, pages, positions % PAGE_TOKENS, attend, decode=True)


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
                           "inside services.rollout.embedded.decoder (it needs the paged KV pool)")
    if attention_mask is not None:
        raise RuntimeError(f"{impl}: got an attention mask; the decoder carries boundaries in its KV layout")
    if dropout or sliding_window is not None or kwargs.get("output_attentions"):
        raise RuntimeError(f"{impl}: dropout, sliding windows and attention outputs are not supported")
    batch, heads, seqlen, head_dim = query.shape
    layer = module.layer_idx
    k_pool, v_pool = lockstep_kv.pool.keys[layer], lockstep_kv.pool.values[layer]
    scale = head_dim**-0.5 if scaling is None else float(scaling)
    if lockstep_kv.decode:
        if seqlen != 1:
            raise RuntimeError(f"{impl}: a decode step feeds one token per row, got {seqlen}")
        new_k, new_v, q = key[:, :, 0], value[:, :, 0], query[:, :, 0]  # [B, Hkv, D], [B, H, D]
    else:
        if batch != 1:
            raise RuntimeError(f"{impl}: prefill is one packed [1, T] buffer, got batch {batch}")
        new_k, new_v, q = key[0].transpose(0, 1), value[0].transpose(0, 1), query[0].transpose(0, 1)  # [T, *, D]
    with unique_index_writes():
        k_pool[lockstep_kv.pages, :, lockstep_kv.slots] = new_k
        v_pool[lockstep_kv.pages, :, lockstep_kv.slots] = new_v
    out = lockstep_kv.attend(q.contiguous(), new_k.contiguous(), new_v.contiguous(), k_pool, v_pool, scale)
    return out.unsqueeze(1 if lockstep_kv.decode else 0), None  # [B, 1, H, D] or [1, T, H, D]
