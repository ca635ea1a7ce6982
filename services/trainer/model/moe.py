"""Mixture-of-experts routing in the trainer: per-microbatch routing statistics, auxiliary router losses,
routing replay, and the step's MoE metrics. Pure bookkeeping over the RouterStates that the patched routers
keep (kernels/moe/hf_blocks.py); nothing here exists for a dense model (`MoeRouting.of` returns None).

Statistics of one microbatch travel as one float64 tensor [layers, E + 4] (MicrobatchResult.moe_stats, so
they cross data-parallel ranks with the other results): tokens routed to each expert (E columns), the sum
of the router entropy over tokens, the tokens, and for routing agreement the tokens whose rollout top-k
set equals the trainer's and the tokens that carried rollout experts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contract.moe_settings import MoeSettings
from kernels.moe.hf_blocks import RouterState, router_states

STAT_COLUMNS = 4
"""Columns after the E expert counts: entropy sum, tokens, agreeing tokens, tokens with rollout experts."""


@dataclass
class MoeRouting:
    states: list[RouterState]
    n_experts: int
    top_k: int
    settings: MoeSettings

    @classmethod
    def of(cls, lm: torch.nn.Module, settings: MoeSettings) -> MoeRouting | None:
        states = router_states(lm)
        if not states:
            return None
        cfg = lm.config
        routing = cls(states, int(cfg.num_experts), int(cfg.num_experts_per_tok), settings)
        for state in states:
            state.keep_logits = settings.has_aux_loss
        return routing

    # ---- replay ---------------------------------------------------------------------------------------
    def force(self, experts: torch.Tensor | None) -> None:
        """Route the next forwards to `experts` [layers, T, k] (token order of the microbatch); None: route."""
        for layer, state in enumerate(self.states):
            state.forced = None if experts is None else experts[layer]

    # ---- statistics -----------------------------------------------------------------------------------
    def microbatch_stats(self, rollout_experts: torch.Tensor | None = None,
                         valid: torch.Tensor | None = None) -> torch.Tensor:
        """[layers, E + 4] float64 on the CPU from the last forward's routing. `rollout_experts` [layers, T, k]
        (the rollout's choice per token, -1 where it sent none) and `valid` [T] (positions to count) are
        optional."""
        rows = []
        for layer, state in enumerate(self.states):
            experts, probs = state.experts, state.probs
            if valid is not None:
                experts, probs = experts[valid], probs[valid]
            counts = torch.zeros(self.n_experts, dtype=torch.float64, device=experts.device)
            counts.scatter_add_(0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.float64,
                                                                   device=experts.device))
            entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1).double().sum()
            agree = carried = torch.zeros((), dtype=torch.float64, device=experts.device)
            if rollout_experts is not None:
                theirs = rollout_experts[layer].to(experts.device)
                if valid is not None:
                    theirs = theirs[valid]
                has = (theirs >= 0).all(-1)
                same = (theirs.sort(-1).values == experts.sort(-1).values).all(-1) & has
                agree, carried = same.double().sum(), has.double().sum()
            extra = torch.stack([entropy, torch.tensor(float(experts.shape[0]), dtype=torch.float64,
                                                        device=experts.device), agree, carried])
            rows.append(torch.cat([counts, extra]))
        return torch.stack(rows).cpu()

    # ---- auxiliary losses -----------------------------------------------------------------------------
    def aux_loss(self, weight: float) -> torch.Tensor | None:
        """The configured router losses of the last forward, times `weight` (the microbatch's share of the
        step's tokens, so the step's sum does not depend on how it was split); None when both are off."""
        s = self.settings
        if not s.has_aux_loss:
            return None
        total = None
        for state in self.states:
            logits = state.logits.float()
            term = torch.zeros((), device=logits.device)
            if s.load_balancing_coef > 0:
                probs = torch.softmax(logits, dim=-1)
                routed = torch.zeros_like(probs).scatter_(-1, state.experts, 1.0)
                fraction = routed.sum(0) / max(state.experts.numel(), 1)
                term = term + s.load_balancing_coef * self.n_experts * (fraction * probs.mean(0)).sum()
            if s.router_z_loss_coef > 0:
                term = term + s.router_z_loss_coef * torch.logsumexp(logits, dim=-1).pow(2).mean()
            total = term if total is None else total + term
            state.logits = None
        return total / len(self.states) * weight


def moe_step_metrics(stats: Sequence[torch.Tensor]) -> dict[str, float]:
    """The step's MoE metrics from its microbatches' stats (in microbatch order): expert load max/mean
    (tokens per expert per layer, summed over the step; max over layers and experts, mean over both),
    dropped tokens (0: no capacity factor drops any), mean router entropy, and routing agreement per
    layer (`moe_routing_agreement_layer_<i>`) and its minimum, when the trajectories carried experts."""
    total = torch.stack(list(stats)).sum(0)  # [layers, E + 4]
    n_experts = total.shape[1] - STAT_COLUMNS
    load = total[:, :n_experts]
    entropy, tokens, agree, carried = total[:, n_experts:].unbind(-1)
    out = {"moe_expert_load_max": float(load.max()), "moe_expert_load_mean": float(load.mean()),
           "moe_dropped_tokens": 0.0,
           "moe_router_entropy": float(entropy.sum() / tokens.sum().clamp_min(1))}
    if float(carried.min()) > 0:
        per_layer = agree / carried
        out.update({f"moe_routing_agreement_layer_{i}": float(v) for i, v in enumerate(per_layer)})
        out["moe_routing_agreement_min"] = float(per_layer.min())
    return out
