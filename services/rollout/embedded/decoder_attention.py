"""What the decoder runs a model's attention through, and the check that it can run the model at all.

- `check_decodable`: DecoderUnsupported for a model the decoder does not implement (sliding-window layers,
  logit softcapping, an output head other than nn.Linear, no base model under base_model_prefix).
- `decoder_attention`: the model on the paged attention function of services.rollout.embedded.kv_cache for the length of
  a decode, on its own implementation after, so it stays a stock HF module for anything else that scores with it.
- `sdpa_paged_decode`: fast-mode decode attention on CPU, torch SDPA over the gathered pages (the
  batch-invariant CPU kernel walks key blocks in Python, and fast mode promises no bits).
- `fast_prefill_attention`: fast-mode packed prefill attention, the attention registry's backend or the
  batch-invariant packed kernel where the registry has none.

They depend on the model and the pool layout only, not on the scheduler or the decode loop.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from services.rollout.embedded.kv_cache import DECODER_ATTN_IMPLEMENTATION, register_decoder_attention
from services.rollout.embedded.scheduler import pages_for


class DecoderUnsupported(ValueError):
    """The model uses something the decoder does not implement (sliding windows, logit softcapping, ...)."""


def check_decodable(model: torch.nn.Module) -> None:
    """DecoderUnsupported naming what this decoder cannot run for `model`."""
    cfg = model.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or getattr(cfg, "use_sliding_window", False):
        raise DecoderUnsupported(f"{type(model).__name__}: sliding-window attention layers are not supported")
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        raise DecoderUnsupported(f"{type(model).__name__}: logit softcapping is not supported")
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise DecoderUnsupported(f"{type(model).__name__}: the output head is not an nn.Linear")
    if not hasattr(model, getattr(model, "base_model_prefix", "")):
        raise DecoderUnsupported(f"{type(model).__name__}: no base model under base_model_prefix")


@contextlib.contextmanager
def decoder_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with the decoder's attention function inside the block; its own implementation after.

    Outside a decode the model stays a stock HF module (so anything else that scores with it keeps working)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(register_decoder_attention())
    if model.config._attn_implementation != DECODER_ATTN_IMPLEMENTATION:
        raise DecoderUnsupported(f"{type(model).__name__}: its attention implementation cannot be set "
                                 "(it does not dispatch through transformers' AttentionInterface)")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def sdpa_paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                       lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """paged decode attention through torch SDPA with a key mask over the gathered pages (fast mode on CPU,
    where reading the lengths costs no device sync): row b attends its keys [0, lengths[b])."""
    used = int(lengths.max())
    pages = tables[:, :pages_for(used)].long()

    def gather(pool):
        g = pool[pages].transpose(1, 2)  # [B, Hkv, P, KB, D]
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])[:, :, :used]

    keys = torch.arange(used, device=q.device)
    mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, used]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], gather(k_pool), gather(v_pool), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k_pool.shape[1])
    return out[:, :, 0]


def fast_prefill_attention(model: torch.nn.Module, device: torch.device) -> tuple[Callable, str]:
    """(packed attention fn, its name) of fast-mode prefill: the attention registry's choice for this
    dtype/device/head size, or, where the registry has no backend for it (float32 on a GPU under
    deterministic algorithms: its fused backends are 16-bit, its reference not deterministic there), the
    batch-invariant packed kernel, which serves every dtype the decoder runs. Engine info reports which."""
    from kernels.attention import REGISTRY, AttentionBackendError, PackedLayout

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        backend = REGISTRY.select(device=device, dtype=next(model.parameters()).dtype, head_dim=head_dim,
                                  packed=True, window=None)
    except AttentionBackendError:
        if REGISTRY.policy.backend is not None:
            raise  # a backend forced by policy is never replaced
        from kernels.batch_invariant import packed_attention

        return packed_attention, "batch_invariant"

    def registry_attention(q, k, v, cu_seqlens, max_seqlen, scale):
        return REGISTRY.attention(q, k, v, PackedLayout(cu_seqlens, max_seqlen), scale=scale)

    return registry_attention, backend.name
