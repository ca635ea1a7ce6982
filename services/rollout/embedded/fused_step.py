"""A true_on_policy decode step's forward on the fused batch-invariant ops, with the stock forward's bits.

The stock path runs the Hugging Face model patched by `make_batch_invariant`: per layer about thirty
kernels (RMSNorms, three projections, two per-head norms, a dozen eager rotary ops, two index writes,
attention, residual adds, SiLU and the product), most of them far shorter than their launch at a few
hundred rows. This forward walks the same modules' parameters through kernels.batch_invariant.fused:

    x = norm(embed(ids))                                     (residual = embed(ids))
    per layer:  qkv = [q | k | v](x)                          grouped_linear: one launch
                q = rope(q_norm(q)); pool <- rope(k_norm(k)), v  qk_norm_rope_store: two launches
                a = paged attention(q, pool)                  the decoder's attend function
                residual, x = residual + o_proj(a), norm(..)  grouped_linear, add_rms_norm
                residual, x = residual + down(silu(gate(x)) * up(x)), next norm(..)
                                                              gate_up, grouped_linear, add_rms_norm
    hidden = x (after the final norm)

Every op is defined as the unfused composition the stock layer runs (the fused kernels are tested
against it bit for bit; the projections run on tiles narrower along N than bi_linear's, whose bits the
GPU tests compare with bi_linear's), so a token's log-prob is the same bits on either path; the decoder's GPU tests
compare the two paths and the trainer's recompute. Prefill keeps the stock forward.

Covered: Qwen3 (per-head q/k norms), Qwen2 and Llama (optional q/k/v/o biases) with plain nn.Linear
projections, SiLU MLPs without biases and the default rotary embedding; Qwen3-MoE and Qwen2-MoE, whose
MoE blocks run as the patched modules themselves (router on bi_linear, the batch-invariant grouped expert
GEMM, shared expert: kernels/moe) on the fused step's normed rows, so their bits are the stock step's by
construction; their attention, norms and residuals are fused as for the dense families. `unsupported_reason` names what
else a model has; the decoder then runs the stock forward.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.batch_invariant.fused import add_rms_norm, gate_up, grouped_linear, qk_norm_rope_store

FAMILIES = ("qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe")
_LINEAR = torch.nn.Linear


def _is_moe_block(mlp: torch.nn.Module) -> bool:
    """A SparseMoeBlock make_batch_invariant patched (its router and experts on kernels/moe)."""
    from kernels.batch_invariant.hf import is_patched

    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    return (type(mlp).__name__.endswith("SparseMoeBlock") and gate is not None and experts is not None
            and is_patched(gate) and is_patched(experts))


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the fused forward cannot run `model` (None: it can)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {list(FAMILIES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (only silu)"
    base = getattr(model, model.base_model_prefix, None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(base, name):
            return f"the base model has no {name}"
    if type(base.embed_tokens) is not torch.nn.Embedding:
        return f"embed_tokens is a {type(base.embed_tokens).__name__}"
    for i, layer in enumerate(base.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return f"layer {i} has no self_attn or mlp"
        moe = type(mlp).__name__.endswith("SparseMoeBlock")
        if moe and not _is_moe_block(mlp):
            return f"layer {i}: the MoE block is not on the batch-invariant router and experts (make_batch_invariant)"
        mlp_names = () if moe else ("gate_proj", "up_proj", "down_proj")
        for part, names in ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, mlp_names)):
            for name in names:
                lin = getattr(part, name, None)
                if type(lin) is not _LINEAR:
                    return f"layer {i} {name} is a {type(lin).__name__}, not an nn.Linear (an adapter?)"
        if not moe and any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i}: MLP biases"
        if len({attn.q_proj.bias is None, attn.k_proj.bias is None, attn.v_proj.bias is None}) != 1:
            return f"layer {i}: some of q/k/v have a bias and some not"
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            return f"layer {i}: only one of q_norm/k_norm"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [attn.q_norm, attn.k_norm] if getattr(attn, "q_norm", None) is not None else []
        for norm in norms:
            if not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
                return f"layer {i}: a norm without weight/variance_epsilon ({type(norm).__name__})"
        if getattr(attn, "sliding_window", None) is not None:
            return f"layer {i}: sliding-window attention"
    return None


class FusedDecodeStep:
    """Hidden states after the final norm, [B, hidden], of one decode step of `model` (see the module docstring).

    Parameters are read from the modules at every call (never copied), so in-place weight updates reach it and
    a captured graph replays on the updated tensors."""

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode step: {reason}")
        cfg = model.config
        self.base = getattr(model, model.base_model_prefix)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.moe = [_is_moe_block(layer.mlp) for layer in self.base.layers]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], pages: torch.Tensor, slots: torch.Tensor,
                 attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]) -> torch.Tensor:
        """ids/positions [B, 1] int64; keys/values: each layer's pool [pages, Hkv, slots, D]; pages/slots [B]: where
        each row's new K/V go; attend(q, k_pool, v_pool, scale) -> [B, H, D] after they are written."""
        base = self.base
        layers = base.layers
        hidden = base.embed_tokens(ids)  # [B, 1, H], as the stock forward embeds
        cos, sin = base.rotary_emb(hidden, positions)  # [B, 1, D] in the model dtype
        cos, sin = cos[:, 0], sin[:, 0]
        first = layers[0].input_layernorm
        residual, x = add_rms_norm(hidden[:, 0], None, first.weight, first.variance_epsilon)
        b = ids.shape[0]
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            qkv = grouped_linear(x, [p.weight for p in projections],
                                 None if attn.q_proj.bias is None else [p.bias for p in projections])
            q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            q = qk_norm_rope_store(qkv, self.n_heads, self.n_kv, None if q_norm is None else q_norm.weight,
                                   None if k_norm is None else k_norm.weight,
                                   1e-6 if q_norm is None else q_norm.variance_epsilon, cos, sin, keys[i], values[i],
                                   pages, slots)
            out = attend(q, keys[i], values[i], attn.scaling)
            out = grouped_linear(out.reshape(b, self.n_heads * self.head_dim), [attn.o_proj.weight],
                                 None if attn.o_proj.bias is None else [attn.o_proj.bias])
            post = layer.post_attention_layernorm
            residual, x = add_rms_norm(out, residual, post.weight, post.variance_epsilon)
            if self.moe[i]:
                out = mlp(x[:, None])[:, 0]  # the patched block itself: the stock step's MoE bits
            else:
                out = grouped_linear(gate_up(x, mlp.gate_proj.weight, mlp.up_proj.weight), [mlp.down_proj.weight])
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else base.norm
            residual, x = add_rms_norm(out, residual, norm.weight, norm.variance_epsilon)
        return x
