"""Forwards for Hugging Face's MoE router and experts modules, and the per-router state they share.

kernels/batch_invariant/hf.py binds `bi_router_forward` and `bi_experts_forward` to every
`*TopKRouter` / `*Experts` module of a covered family in `true_on_policy`; `observe_routing` binds
`fast_router_forward` and `fast_experts_module_forward` (kernels/moe/fast_experts.py) in `fast` mode. Either
router forward returns what Hugging Face's does — (router logits, top-k weights in the logits' dtype,
top-k expert ids) — so the stock SparseMoeBlock, the output recorders and the aux loss see the same
interface, and keeps a `RouterState` on the module:

* `experts`/`probs`: the last call's chosen experts [T, k] and float32 probabilities [T, E] (detached),
  read by the trainer's routing metrics and by the rollout engine, which returns them with each token;
* `forced`: expert ids [T, k] the next calls must use (routing replay); the weights then come from
  the token's own probabilities at those experts. The caller sets and clears it around a forward
  (activation checkpointing may run the router twice on the same tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.moe.experts import experts_forward
from kernels.moe.routing import check_forced, route, router_probabilities, top_k_lowest_index

STATE_ATTR = "lockstep_routing"


@dataclass
class RouterState:
    layer: int
    """Index of the decoder layer the router belongs to."""
    forced: torch.Tensor | None = None
    """Expert ids [T, k] to use instead of the router's top-k (routing replay); None: route."""
    experts: torch.Tensor | None = None
    """The last call's experts [T, k] (int64, detached): the forced ones under replay."""
    own: torch.Tensor | None = None
    """The experts the router itself chose in the last call [T, k] (== experts unless forced)."""
    probs: torch.Tensor | None = None
    """The last call's router probabilities [T, E] (float32, detached)."""
    keep_logits: bool = False
    """Keep the last call's router logits with their autograd graph in `logits` (auxiliary router losses)."""
    logits: torch.Tensor | None = None
    """The last call's router logits [T, E] in the compute dtype, with their graph (only with keep_logits)."""


def router_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (modules whose class name ends in TopKRouter)."""
    return [m for _n, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]


def attach_states(model: torch.nn.Module) -> list[RouterState]:
    """A RouterState on every router (kept if present), in layer order."""
    states = []
    for layer, module in enumerate(router_modules(model)):
        if STATE_ATTR not in module.__dict__:
            module.__dict__[STATE_ATTR] = RouterState(layer)
        states.append(module.__dict__[STATE_ATTR])
    return states


def router_states(model: torch.nn.Module) -> list[RouterState]:
    """The routers' states in layer order ([] for a dense model or one never patched)."""
    return [m.__dict__[STATE_ATTR] for m in router_modules(model) if STATE_ATTR in m.__dict__]


def _state(module: torch.nn.Module) -> RouterState:
    return module.__dict__[STATE_ATTR]


def _finish(module: torch.nn.Module, logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
            probs: torch.Tensor, own: torch.Tensor | None = None):
    state = _state(module)
    state.experts, state.probs = experts.detach(), probs.detach()
    state.own = state.experts if own is None else own.detach()
    state.logits = logits if state.keep_logits else None
    return logits, weights.to(logits.dtype), experts


def bi_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """Router logits through bi_linear, then routing.route (fixed-order softmax, lowest-index ties)."""
    from kernels.batch_invariant import bi_linear

    logits = bi_linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    forced = _state(self).forced
    weights, experts = route(logits, self.top_k, self.norm_topk_prob, forced=forced)
    probs = router_probabilities(logits.detach())
    own = None if forced is None else top_k_lowest_index(probs, self.top_k)[1]
    return _finish(self, logits, weights, experts, probs, own)


def fast_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    """Hugging Face's router math (F.linear, softmax, torch.topk) with recording and replay."""
    logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    forced = _state(self).forced
    values, experts = torch.topk(probs, self.top_k, dim=-1)
    own = None
    if forced is not None:
        own = experts
        experts = check_forced(forced.to(logits.device), logits.shape[0], logits.shape[-1], self.top_k)
        values = probs.gather(-1, experts)
    if self.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return _finish(self, logits, values, experts, probs, own)


def bi_shared_expert_block_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE's SparseMoeBlock: Hugging Face's forward with the shared expert's sigmoid gate through
    kernels/moe/rowwise.py (a [T, 1] tensor puts rows on the CPU's scalar tail; see that module)."""
    from kernels.moe.rowwise import rowwise

    batch, length, hidden = hidden_states.shape
    rows = hidden_states.view(-1, hidden)
    shared = self.shared_expert(rows)
    _logits, weights, experts = self.gate(rows)
    routed = self.experts(rows, experts, weights)
    out = routed + rowwise(torch.sigmoid, self.shared_expert_gate(rows)) * shared
    return out.reshape(batch, length, hidden)


def fast_experts_module_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                top_k_weights: torch.Tensor) -> torch.Tensor:
    """`fast` mode's experts: kernels/moe/fast_experts.py (torch's grouped matmul, deterministic)."""
    from kernels.moe.fast_experts import fast_experts_forward

    return fast_experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                self.act_fn)


def _check_experts_layout(module: torch.nn.Module) -> None:
    """The layout fast_experts_forward computes with: gate_up_proj [E, 2I, H] (gate rows first), down_proj
    [E, H, I], no biases; anything else is refused, naming the module's class."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if (not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3
            or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]
            or getattr(module, "has_bias", False) or getattr(module, "is_transposed", False)
            or not getattr(module, "is_concatenated", True)):
        raise TypeError(f"{type(module).__name__}: the fast experts forward needs gate_up_proj [E, 2I, H] "
                        "(concatenated), down_proj [E, H, I] and no biases")


def observe_routing(model: torch.nn.Module) -> list[RouterState]:
    """`fast` mode: every router not already on the batch-invariant forward runs `fast_router_forward`
    (Hugging Face's math, plus recording and replay), and its experts `fast_experts_module_forward` (the
    same function as Hugging Face's grouped_mm experts, with fewer memory passes; fast_experts.py).
    Idempotent; a model already on the batch-invariant forwards keeps them."""
    import types

    for _name, module in model.named_modules():
        bound = getattr(module.__dict__.get("forward"), "__func__", None)
        kind = type(module).__name__
        if kind.endswith("TopKRouter") and bound not in (bi_router_forward, fast_router_forward):
            module.forward = types.MethodType(fast_router_forward, module)
        elif kind.endswith("Experts") and bound not in (bi_experts_forward, fast_experts_module_forward):
            _check_experts_layout(module)
            module.forward = types.MethodType(fast_experts_module_forward, module)
    return attach_states(model)


def bi_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts on the batch-invariant grouped GEMM of the device, combined in rank order."""
    return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           self.act_fn, impl="auto")
