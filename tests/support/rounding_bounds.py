"""Bounds on how far two float32 evaluations of the same function may differ, derived from the dtype's
unit roundoff instead of measured on one machine.

Two evaluations of one product by differently shaped GEMMs (a row inside a [T, K] product and alone in
an [L, K] one) may sum in different orders; every order obeys the standard bound for a length-K dot
product, |fl(x.w) - x.w| <= gamma_K |x|.|w| with gamma_n = n u / (1 - n u) and u = eps / 2 (Higham,
Accuracy and Stability of Numerical Algorithms, 2nd ed., sec. 3.1), so two of them differ by at most
twice that. Which order a CPU takes depends on its vector width, its BLAS and its thread count, so
that is all a test may rely on.

`causal_lm_logprob_bounds` carries such bounds through a whole Qwen3-style decoder to per-token
log-probs, to first order: every place the float32 computation rounds (a GEMM output, a normalisation,
an attention output, a residual add) is a site with an elementwise error bound m; the log-prob's
sensitivity g to that site is the float64 gradient; the log-prob moves by at most sum |g| m. The
neglected second-order terms are products of two first-order ones, small next to the bound b while
b << 1. (HF's RMSNorm computes in float32 even in a float64 model: g and m carry a relative error of
~1e-7, immaterial to a bound.) Worst-case bounds of this kind sit orders of magnitude above the gaps
a CPU actually gives (most rows are bitwise equal, the rest an ulp or two apart); they are what the
code guarantees on any CPU, and still far below what a real defect (attention leaking across packed
sequences, stale weights) costs.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the distance from 1.0 to the next float: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of n chained roundings (e.g. a length-n sum)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"gamma_{n} undefined for {dtype}"
    return nu / (1 - nu)


def _site(value: torch.Tensor, magnitude: torch.Tensor, sites: list) -> torch.Tensor:
    """value + a zero leaf whose gradient is the output's sensitivity to an error at this place."""
    leaf = torch.zeros_like(value, requires_grad=True)
    sites.append((leaf, magnitude.expand_as(value).detach()))
    return value + leaf


def _attention_error(seen: dict, heads: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Bound on one evaluation's own rounding of causal attention over one sequence, per element of its
    [1, L, heads * d] output, from the float64 q, k (after their norms), v and rotary tables."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    u = unit_roundoff(dtype)
    q, k, v = seen["q"].transpose(1, 2), seen["k"].transpose(1, 2), seen["v"]  # [1, H, L, d]
    assert q.shape[0] == 1, "the float64 pass runs one sequence per forward"
    v = v.view(*v.shape[:2], -1, q.shape[-1]).transpose(1, 2)
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    q_r, k_r = apply_rotary_pos_emb(q, k, seen["rotary"]["cos"], seen["rotary"]["sin"])
    d, L = q.shape[-1], q.shape[-2]
    # Rotary: |q_rot| <= sqrt(2) max|q| per pair; three roundings, and cos, sin each up to 2 u apart
    # between kernels: 10 u sqrt(2) |q| per element, bounded here by the row's max.
    dq = 10 * u * math.sqrt(2) * q.abs().amax(-1, keepdim=True)
    dk = 10 * u * math.sqrt(2) * k.abs().amax(-1, keepdim=True)
    s = scale * q_r @ k_r.transpose(-1, -2)
    ds = scale * (gamma(d + 1, dtype) * (q_r.abs() @ k_r.abs().transpose(-1, -2))
                  + dq @ k_r.abs().sum(-1, keepdim=True).transpose(-1, -2)
                  + q_r.abs().sum(-1, keepdim=True) @ dk.transpose(-1, -2))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    s = s.masked_fill(~causal, float("-inf"))
    p = torch.softmax(s, -1)
    # A probability's relative error: its own and the row's largest score error (softmax normalises),
    # the rounding of exp's argument s - max, and the sum over L with its division.
    ds_row = ds.masked_fill(~causal, 0).amax(-1, keepdim=True)
    gap = (s - s.amax(-1, keepdim=True)).masked_fill(~causal, 0).abs()
    rel_p = ds + ds_row + u * gap + gamma(L + 3, dtype)
    # o = P @ V: the probabilities' errors, plus the sum over L (and a blocked kernel's rescalings).
    err = (rel_p * p) @ v.abs() + 2 * gamma(L + 3, dtype) * (p @ v.abs())  # [1, H, L, d]
    return err.transpose(1, 2).reshape(1, L, -1)


def causal_lm_logprob_bounds(model: torch.nn.Module, logits_of: Callable[[torch.nn.Module], torch.Tensor],
                             targets: torch.Tensor, only: torch.Tensor | None = None, temperature: float = 1.0,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per target: a bound on |a - b| for the log-probs a, b of two `dtype` evaluations of the same
    Qwen3-style causal LM that may round differently (other GEMM shapes, packed or one sequence at a
    time, other vector kernels), to first order in u.

    `logits_of(m)` runs the forward on a float64 copy m of `model`, one sequence per call of m (the same
    function as a packed call), and returns the logit rows [N, V] of `targets` [N]; `only` (bool [N])
    limits the bound to some rows (0 elsewhere: a backward pass per row is the cost); log-probs are of
    logits / `temperature`, as the log-prob kernel computes them. Error bounds per site, for
    one evaluation (two evaluations: twice that):
    - GEMM output (K inputs): gamma_K |x| |W|^T.
    - RMSNorm over n elements (a sum of squares, rsqrt, two products): gamma_{n+4} |y|.
    - SiLU(gate) * up (exp, add, divide, two products): gamma_8 |y|.
    - residual add: u |h|.
    - attention output (rotary, q.k over head_dim d, softmax over L, P @ V over L): see _attention_error,
      computed per element from the float64 q, k, v of that sequence.
    """
    u = unit_roundoff(dtype)
    m64 = copy.deepcopy(model).double()
    for p in m64.parameters():
        p.requires_grad_(False)
    sites: list[tuple[torch.Tensor, torch.Tensor]] = []
    handles = []
    rotary_seen: dict[str, torch.Tensor] = {}

    def on_output(fn):
        return lambda mod, args, out: fn(mod, args[0], out)

    def gemm_error(mod, x):
        return gamma(mod.in_features, dtype) * (x.abs() @ mod.weight.abs().T)

    def gemm(mod, x, y):
        return _site(y, gemm_error(mod, x), sites)

    def norm(mod, x, y):
        return _site(y, gamma(y.shape[-1] + 4, dtype) * y.abs(), sites)

    cfg = model.config
    d = cfg.head_dim
    scale = d ** -0.5
    for layer in m64.model.layers:
        att, mlp, seen = layer.self_attn, layer.mlp, {"rotary": rotary_seen}

        def keep(name, seen=seen):
            def hook(mod, x, y):
                seen[name] = y.detach()
            return hook

        def layer_in(mod, args, kwargs, seen=seen):
            seen["h_in"] = (args[0] if args else kwargs["hidden_states"]).detach()

        handles.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))
        for lin in (att.q_proj, att.k_proj, att.v_proj, mlp.gate_proj, mlp.up_proj):
            handles.append(lin.register_forward_hook(on_output(gemm)))
        for nm in (layer.input_layernorm, layer.post_attention_layernorm, att.q_norm, att.k_norm):
            handles.append(nm.register_forward_hook(on_output(norm)))
        handles.append(att.q_norm.register_forward_hook(on_output(keep("q"))))
        handles.append(att.k_norm.register_forward_hook(on_output(keep("k"))))
        handles.append(att.v_proj.register_forward_hook(on_output(keep("v"))))

        def attention_out(mod, args, seen=seen, heads=cfg.num_attention_heads):
            return (_site(args[0], _attention_error(seen, heads, scale, dtype), sites),)

        def silu_times_up(mod, args):
            return (_site(args[0], gamma(8, dtype) * args[0].abs(), sites),)

        def o_out(mod, args, y, seen=seen):
            h_mid = seen["h_in"] + y
            seen["h_mid"] = h_mid.detach()
            return _site(y, gemm_error(mod, args[0]) + u * h_mid.abs(), sites)

        def down_out(mod, args, y, seen=seen):
            h_out = seen["h_mid"] + y
            return _site(y, gemm_error(mod, args[0]) + u * h_out.abs(), sites)

        handles.append(att.o_proj.register_forward_pre_hook(attention_out))
        handles.append(att.o_proj.register_forward_hook(o_out))
        handles.append(mlp.down_proj.register_forward_pre_hook(silu_times_up))
        handles.append(mlp.down_proj.register_forward_hook(down_out))
    rotary = m64.model.rotary_emb
    handles.append(rotary.register_forward_hook(lambda mod, args, out: rotary_seen.update(cos=out[0], sin=out[1])))
    handles.append(m64.model.norm.register_forward_hook(on_output(norm)))
    handles.append(m64.lm_head.register_forward_hook(on_output(gemm)))
    try:
        with torch.enable_grad():
            logits = logits_of(m64) / temperature
            logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
            leaves = [s[0] for s in sites]
            bound = torch.zeros(logp.shape[0], dtype=torch.float64)
            wanted = torch.ones_like(targets, dtype=torch.bool) if only is None else only
            for i in wanted.nonzero().flatten().tolist():
                grads = torch.autograd.grad(logp[i], leaves, retain_graph=True, allow_unused=True)
                bound[i] = sum((g.abs() * m).sum() for g, (_, m) in zip(grads, sites) if g is not None)
    finally:
        for h in handles:
            h.remove()
    # Twice each evaluation's error at every site, plus the log-prob kernel's own rounding: the sum of
    # V exps (relative, absolute after the log), u |x| for the division by the temperature (moving the
    # log-prob by up to 2 u max|x|), for exp's arguments x - max and for the final differences.
    lse = torch.logsumexp(logits.detach(), -1)
    kernel = gamma(logits.shape[-1] + 4, dtype) + u * (8 * logits.detach().abs().amax(-1) + lse.abs())
    return (2 * bound + 2 * kernel) * wanted


def response_logprob_bounds(model: torch.nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                            temperature: float = 1.0, only: torch.Tensor | None = None) -> torch.Tensor:
    """causal_lm_logprob_bounds for every response token of each (prompt, response), in order: the
    float64 pass runs each sequence alone on sdpa (a packed evaluation computes the same function).

    Each sequence gets a graph of its own: a token's log-prob depends on its own sequence's sites only,
    so the bound is the same sum as over one graph of all sequences (the other sequences' terms are
    zeros), while each per-token backward pass runs through one sequence instead of all of them."""
    def logits_of(prompt: Sequence[int], response: Sequence[int]) -> Callable[[torch.nn.Module], torch.Tensor]:
        def run(m: torch.nn.Module) -> torch.Tensor:
            m.set_attn_implementation("sdpa")
            return m(input_ids=torch.tensor([[*prompt, *response]]), use_cache=False).logits[0, len(prompt) - 1:-1]
        return run

    bounds, start = [], 0
    for prompt, response in pairs:
        targets = torch.tensor(list(response), dtype=torch.long)
        rows = None if only is None else only[start:start + len(response)]
        bounds.append(causal_lm_logprob_bounds(model, logits_of(prompt, response), targets, only=rows,
                                               temperature=temperature))
        start += len(response)
    return torch.cat(bounds) if bounds else torch.zeros(0, dtype=torch.float64)
