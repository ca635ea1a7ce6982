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

from contract.models.moe_settings import MoeSettings
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
        """[layers, E + 4] float64 on the routing's device (read back once the step's passes are done) from the
        last forward's routing. `rollout_experts` [layers, T, k]
        (the rollout's choice per token, -1 where it sent none) and `valid` [T] (positions to count) are
        optional."""
        rows = []
        for layer, state in enumerate(self.states):
            # Load counts what ran (the forced experts under replay); agreement compares the rollout's
            # choice with the router's own, so under replay it counts the tokens replay did not re-route.
            experts, own, probs = state.experts, state.own, state.probs
            if valid is not None:
                experts, own, probs = experts[valid], own[valid], probs[valid]
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
                same = (theirs.sort(-1).values == own.sort(-1).values).all(-1) & has
                agree, carried = same.double().sum(), has.double().sum()
            extra = torch.stack([entropy, torch.tensor(float(experts.shape[0]), dtype=torch.float64,
                                                        device=experts.device), agree, carried])
            rows.append(torch.cat([counts, extra]))
        return torch.stack(rows)

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


# ---- the rollout's experts on the wire -----------------------------------------------------------------
def check_routed_experts(samples, *, layers: int, n_experts: int, top_k: int, required: bool) -> None:
    """Refuse (InvalidRequest naming the trajectory) expert ids the model cannot have produced: the wrong
    number of layers or experts per token, an id out of range or repeated within a token, a position the
    model read without a full set of ids, or the padded last position (never read) carrying an id.
    `required`: routing replay needs every trajectory to carry them."""
    from services.trainer.data.wire import InvalidRequest

    for i, sample in enumerate(samples):
        where = f"trajectory[{i}] (sample_id {sample.sample_id!r}).routed_experts"
        routed = sample.routed_experts
        if routed is None:
            if required:
                raise InvalidRequest(f"{where}: absent, but trainer.moe.routing_replay needs the rollout's experts "
                                     "for every token")
            continue
        if tuple(routed.shape[1:]) != (layers, top_k):
            raise InvalidRequest(f"{where}: {tuple(routed.shape[1:])} (layers, experts per token) per token, the "
                                 f"model has ({layers}, {top_k})")
        read, last = routed[:-1], routed[-1]
        if bool((last >= 0).any()):
            raise InvalidRequest(f"{where}: position {routed.shape[0] - 1} (the last token, never read by the "
                                 "model) is padding but carries an expert id")
        if bool((read < 0).any()):
            pos = int((read < 0).any(-1).any(-1).nonzero()[0, 0])
            raise InvalidRequest(f"{where}: position {pos} was read by the model but has no expert id (padding)")
        if read.numel() and int(read.max()) >= n_experts:
            raise InvalidRequest(f"{where}: expert id {int(read.max())} out of range (the model has {n_experts} "
                                 "experts)")
        if top_k > 1 and read.numel() and bool((read.sort(-1).values.diff(dim=-1) == 0).any()):
            raise InvalidRequest(f"{where}: a token lists one expert twice")


def microbatch_routing(microbatch, ordered) -> torch.Tensor | None:
    """The rollout's experts [layers, T, k] of a packed microbatch's positions (-1 where a sequence sent
    none), None when no sequence of it sent any or the layout is not packed."""
    members = getattr(microbatch, "samples", None)
    if members is None or all(ordered[i].routed_experts is None for i in members):
        return None
    example = next(ordered[i].routed_experts for i in members if ordered[i].routed_experts is not None)
    parts = []
    for i in members:
        s = ordered[i]
        fed = s.num_tokens - 1
        parts.append(s.routed_experts[:fed] if s.routed_experts is not None
                     else torch.full((fed, *example.shape[1:]), -1, dtype=torch.int64))
    return torch.cat(parts).permute(1, 0, 2).contiguous()


def check_routing(run, samples) -> None:
    """The routing checks of a step's trajectories against the run's model (nothing for a dense model, which
    refuses routed experts outright)."""
    from services.trainer.data.wire import InvalidRequest

    cfg = run.policy.lm.config
    if MoeRouting.of(run.policy.lm, run.config.moe) is None:
        for i, sample in enumerate(samples):
            if sample.routed_experts is not None:
                raise InvalidRequest(f"trajectory[{i}] (sample_id {sample.sample_id!r}).routed_experts: the model "
                                     "has no mixture-of-experts layers")
        return
    layers = len(router_states(run.policy.lm))
    check_routed_experts(samples, layers=layers, n_experts=int(cfg.num_experts), top_k=int(cfg.num_experts_per_tok),
                         required=run.config.moe.routing_replay)
