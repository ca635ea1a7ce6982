"""Hugging Face integration: any HF causal LM runs packed through the registry.

    from kernels.attention.hf import register_hf_attention, packed_forward_kwargs
    name = register_hf_attention()                 # "lockstep_packed", idempotent
    model.set_attn_implementation(name)            # or from_pretrained(..., attn_implementation=name)
    out = model(input_ids=ids[None], **packed_forward_kwargs(position_ids, cu_seqlens, max_seqlen))

How transformers (5.x) routes a packed batch, and the traps closed here:
- The model forwards `**kwargs` down to the attention function, so the four
  varlen kwargs `cu_seq_lens_q/k`, `max_length_q/k` and `position_ids` reach
  `hf_attention_forward` untouched. HF's own flash path uses them only if all
  four are present and otherwise silently falls back to inferring boundaries
  from position_ids (or to no boundaries at all). Here: all four or none;
  a partial set raises.
- A 2-D attention mask makes HF's flash path unpad/repad by the mask and
  ignore cu_seqlens; under sdpa it is expanded to one causal mask over the
  whole buffer. Here: any attention mask raises. Packing carries
  boundaries in cu_seqlens and has no padding to mask.
- Mask construction: for an implementation with no function registered in
  `AttentionMaskInterface`, `create_causal_mask` returns None and *drops* a
  caller's 2-D mask (transformers 5.24), so a padded batch would silently run
  unpadded. We register `hf_mask_refusing_padding`: it never builds a mask
  (no 4-D mask over a packed buffer, whatever position_ids look like) and
  raises on any 2-D mask. A 4-D mask bypasses mask functions and reaches
  `hf_attention_forward`, which raises too.
- Without the varlen kwargs, every row of [B, S] is one whole sequence; a
  position_ids row that restarts (packed data without boundaries) raises.
- No KV cache, dropout, softcap or attention sinks: the training contract is
  causal self-attention over the whole buffer; anything else raises.
"""
from __future__ import annotations

import functools

import torch

from kernels.attention.contract import AttentionContractError, PackedLayout, check_layout_values
from kernels.attention.registry import REGISTRY

HF_ATTN_IMPLEMENTATION = "lockstep_packed"
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# kwargs of HF's paged/decode paths: they change the semantics, so their presence is refused.
_REFUSED_KWARGS = ("block_table", "k_cache", "v_cache", "seqused_k", "s_aux", "softcap")


def register_hf_attention() -> str:
    """Register the attention and its mask function with transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_attention_forward)
    AttentionMaskInterface.register(HF_ATTN_IMPLEMENTATION, hf_mask_refusing_padding)
    return HF_ATTN_IMPLEMENTATION


def hf_mask_refusing_padding(batch_size: int, q_length: int, kv_length: int, *, attention_mask=None, **kwargs):
    """HF mask function for this implementation: never builds a mask, refuses a 2-D one.

    Without a registered mask function, transformers (5.x) *drops* a 2-D attention mask for a
    custom implementation (create_causal_mask returns None), so a padded batch would run as if
    unpadded, silently. Registering this one makes the 2-D mask reach us, and we refuse it.
    """
    if attention_mask is not None:
        raise AttentionContractError(
            f"{HF_ATTN_IMPLEMENTATION}: got a {attention_mask.dim()}-D attention_mask; packed batches carry their "
            "boundaries in cu_seq_lens_q/k and have no padding (HF would otherwise drop the mask or build one "
            "causal mask over the whole buffer, ignoring cu_seqlens). Pass attention_mask=None.")
    return None


def packed_forward_kwargs(position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> dict:
    """The model kwargs for one packed microbatch: all four varlen kwargs, restarting positions, no mask.

    position_ids: [T] or [1, T]; cu_seqlens: int32 [N+1] on the model's device; max_seqlen: int.
    The same cu_seqlens object goes to q and k so the per-layout check runs once per forward.
    """
    if cu_seqlens.dtype != torch.int32:
        raise AttentionContractError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    return {
        "position_ids": position_ids.reshape(1, -1),
        "attention_mask": None,
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": int(max_seqlen),
        "max_length_k": int(max_seqlen),
    }


@functools.lru_cache(maxsize=16)
def _row_layout(batch: int, seqlen: int, device: torch.device) -> PackedLayout:
    # Cached so every layer of a forward sees the same cu_seqlens object (one value check per forward).
    cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
    return PackedLayout(cu, seqlen)


def _as_int(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise AttentionContractError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        return int(value)  # device sync; packed_forward_kwargs passes ints and avoids it
    if not isinstance(value, int) or isinstance(value, bool):
        raise AttentionContractError(f"{name} must be an int, got {type(value).__name__}")
    return value


# Never traced by torch.compile (the trainer's compile_layers compiles the decoder layers around it):
# the contract checks sync with the host and cache layouts by tensor identity, which would become
# guards that recompile every microbatch, and the attention kernels are fused already.
@torch.compiler.disable
def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention-interface function: [B, Hq, S, D] q and [B, Hkv, S, D] k/v in, [B, S, Hq, D] out."""
    impl = HF_ATTN_IMPLEMENTATION
    if attention_mask is not None:
        raise AttentionContractError(
            f"{impl}: got a {attention_mask.dim()}-D attention_mask; packed batches carry their boundaries in "
            "cu_seq_lens_q/k and have no padding. A mask would make HF unpad/repack by it (flash) or build one "
            "causal mask over the whole buffer (sdpa), ignoring cu_seqlens. Pass attention_mask=None.")
    for name in _REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise AttentionContractError(f"{impl}: {name!r} is not supported by the packed training contract")
    if kwargs.get("output_attentions"):
        raise AttentionContractError(f"{impl}: output_attentions=True is not supported (no attention weights)")
    if dropout:
        raise AttentionContractError(f"{impl}: attention dropout={dropout} would break trainer/rollout parity")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise AttentionContractError(f"{impl}: only causal self-attention is supported")
    batch, hq, seqlen, head_dim = query.shape
    if key.shape[2] != seqlen:
        raise AttentionContractError(
            f"{impl}: key length {key.shape[2]} != query length {seqlen} (a KV cache?); "
            "the packed contract is self-attention over the whole buffer")

    given = [n for n, x in zip(VARLEN_KWARGS, (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k))
             if x is not None]
    if given:
        if len(given) != 4:
            missing = [n for n in VARLEN_KWARGS if n not in given]
            raise AttentionContractError(
                f"{impl}: packed input must carry all four of {VARLEN_KWARGS}; missing {missing} "
                "(HF silently ignores a partial set)")
        if batch != 1:
            raise AttentionContractError(f"{impl}: packed input must have batch size 1, got {batch}")
        if cu_seq_lens_q is not cu_seq_lens_k and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):
            raise AttentionContractError(f"{impl}: cu_seq_lens_q != cu_seq_lens_k (self-attention needs one layout)")
        mq, mk = _as_int("max_length_q", max_length_q), _as_int("max_length_k", max_length_k)
        if mq != mk:
            raise AttentionContractError(f"{impl}: max_length_q={mq} != max_length_k={mk}")
        layout = PackedLayout(cu_seq_lens_q, mq)
    else:
        # No boundaries given: each row is one sequence. position_ids that restart inside a row mean
        # packed data whose boundaries were lost; check_layout_values refuses them.
        layout = _row_layout(batch, seqlen, query.device)
        if position_ids is not None and position_ids.shape[0] == 1 and batch > 1:
            # HF broadcasts one [1, S] row over the batch: check that row once, as a one-row layout.
            check_layout_values(_row_layout(1, seqlen, query.device), seqlen, position_ids)
            position_ids = None

    total = batch * seqlen
    q = query.transpose(1, 2).reshape(total, hq, head_dim)
    k = key.transpose(1, 2).reshape(total, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(total, value.shape[1], value.shape[3])
    out = REGISTRY.attention(q, k, v, layout, scale=scaling, window=sliding_window, position_ids=position_ids)
    return out.view(batch, seqlen, hq, -1), None
