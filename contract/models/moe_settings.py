"""The `trainer.moe` section of a run spec: mixture-of-experts training options (pydantic only, no torch).

Off by default, as for the RL runs of verl, slime and NeMo-RL: a policy-gradient step should not pull the
router towards balance at the cost of the policy it is improving. docs/moe.md explains each term.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MoeSettings(BaseModel):
    """Mixture-of-experts options of a run (refused for a dense model, naming the field)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True, frozen=True)

    load_balancing_coef: float = Field(
        0.0, ge=0, le=1.0, description="Weight of the Switch-style load-balancing loss, num_experts x sum_e "
        "f_e P_e per MoE layer (f_e: fraction of the microbatch's routed slots that went to expert e, P_e: its "
        "mean router probability), averaged over layers; 0 (default) adds nothing.")
    router_z_loss_coef: float = Field(
        0.0, ge=0, le=1.0, description="Weight of the router z-loss, the mean over tokens of logsumexp(router "
        "logits)^2 per MoE layer, averaged over layers (ST-MoE); 0 (default) adds nothing.")
    routing_replay: bool = Field(
        False, description="Routing replay (numerics 'fast' only): the trainer routes each token to the experts "
        "the rollout engine chose for it (sent with the trajectory), so both sides use the same experts even "
        "where their router logits differ in the last bits. true_on_policy routes identically by construction "
        "and refuses it.")

    @property
    def has_aux_loss(self) -> bool:
        return self.load_balancing_coef > 0 or self.router_z_loss_coef > 0
