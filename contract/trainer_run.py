"""Per-run trainer settings, the `trainer` section of a run spec: pydantic only, no torch.

`TrainerRunConfig` arrives per run as JSON in ConfigureRun; the coordinator
embeds the same model in its run spec, so a bad value is refused at submit
time with the same field name it would get in the trainer.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError, field_validator, model_validator

from contract.models.moe_settings import MoeSettings
from contract.trainer_settings import (
    BATCH_INVARIANT_ATTENTION,
    AttentionPolicy,
    LoraSettings,
    LossAggregation,
    LRSchedule,
    MismatchCorrection,
    Numerics,
    ParityThresholds,
    PolicyLoss,
    TeacherSettings,
    check_bound_outside_clip,
)


class TrainerRunConfig(BaseModel):
    """Per-run trainer settings (sent as JSON in ConfigureRun.trainer_config_json).

    Strict (no `true` for a number, no `5.5` for an integer) and bounded: a value no run could train with
    is refused with its name when the run is submitted, not found at step 1.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    lr: float = Field(
        1e-5, gt=0, le=1.0, description="AdamW peak learning rate; lr_schedule scales it per step (by default it stays "
        "at this value every step)."
    )
    lr_schedule: LRSchedule = Field(
        default_factory=LRSchedule,
        description="Learning-rate schedule: linear warmup, then constant, linear or cosine decay to "
        "lr * min_lr_ratio. A pure function of the step, so resumed and replayed steps use the same rate.",
    )
    # strict=False lets YAML/Python lists in; each element stays a strict float.
    betas: tuple[StrictFloat, StrictFloat] = Field((0.9, 0.999), strict=False,
                                                   description="AdamW (beta1, beta2), each in [0, 1).")
    weight_decay: float = Field(0.0, ge=0, le=10.0, description="AdamW decoupled weight decay.")
    eps: float = Field(1e-8, ge=1e-30, le=1.0, description="AdamW epsilon.")
    grad_clip: float = Field(
        1.0, ge=0, le=1e6, description="Clip the global gradient L2 norm to this value (0 = measure but never clip)."
    )
    clip_eps_low: float = Field(
        0.2, ge=0, lt=1, description="PPO clip: ratios below 1 - clip_eps_low stop contributing gradient."
    )
    clip_eps_high: float = Field(
        0.2, ge=0, le=100.0, description="PPO clip: ratios above 1 + clip_eps_high stop contributing gradient (DAPO uses 0.28)."
    )
    kl_coef: float = Field(
        0.0, ge=0, le=1e3, description="Weight of the k3 KL penalty to the frozen initial policy (0 = no reference model)."
    )
    microbatch_tokens: int = Field(
        4096,
        ge=1,
        le=1 << 24,
        description="Token budget of one forward/backward microbatch, counted as padded tokens "
        "(rows x longest row). A single sequence longer than the budget trains alone.",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        le=10.0,
        description="The rollout's sampling temperature. The trainer scores tokens with "
        "log_softmax(logits / temperature), the same definition the rollout reports.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype: forward and backward run on this cast of the weights, and GetWeights "
        "streams it (tensor.to(dtype) of each master, round to nearest even). Master weights, gradients and AdamW "
        "state are float32 whatever this says, so small updates at RL learning rates are not rounded away."
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in backward instead of keeping them "
        "(less memory for longer microbatches; the step's numbers are unchanged)."
    )
    compile_layers: bool = Field(
        False, description="Compile each decoder layer's forward with torch.compile (inductor), fusing the "
        "elementwise work around the matmuls and attention (RMSNorm, rotary, SiLU-and-mul, residual adds). Faster "
        "on GPUs; the first steps pay the compile. Still deterministic run to run, but fused bf16 rounding differs "
        "from the eager kernels', so a compiled run's numbers are not an eager run's bits."
    )
    optimizer_offload: bool = Field(
        False, description="Keep master weights, gradients and AdamW state in CPU memory and step the optimizer "
        "there (FSDP CPU offload): for models whose float32 state does not fit the accelerators."
    )
    policy_loss: PolicyLoss = Field(
        default_factory=PolicyLoss,
        description="Policy-gradient objective: 'ppo_clip' (token-level PPO-clip with clip_eps_low/high), 'gspo' "
        "(sequence-level ratio and clip) or 'm2po' (second-moment token masking, unclipped ratio). The ratio is "
        "taken against the PPO old policy mismatch_correction chooses (services/trainer/loss/policy_loss.py).",
    )
    loss_agg: LossAggregation = Field(
        "token_mean",
        description="Loss aggregation over the step: 'token_mean' = sum of every response token's loss / the "
        "step's response-token count; 'seq_mean_token_mean' = mean over sequences of each sequence's token mean; "
        "'seq_mean_token_sum_norm' (Dr. GRPO) = mean over sequences of each sequence's token sum / "
        "loss_agg_tokens. Step-wide divisors only, so the microbatch split does not change the update. Default "
        "'token_mean', but 'seq_mean_token_mean' when policy_loss.kind is 'gspo' (GSPO's objective is a mean over "
        "sequences; token_mean would weight each sequence by its length): a loss_agg the spec sets is kept.",
    )
    loss_agg_tokens: int | None = Field(
        None, ge=1, le=1 << 24,
        description="The constant each sequence's token sum is divided by under loss_agg "
        "'seq_mean_token_sum_norm' (required there, refused otherwise): Dr. GRPO uses the generation budget, "
        "so set the run's sampling max_new_tokens.",
    )
    advantage_std_normalization: bool = Field(
        True,
        description="GRPO advantage (reward - group mean) / group std (true) or Dr. GRPO's reward - group mean "
        "(false). The coordinator computes advantages, so it reads this; the trainer does not.",
    )
    batching: Literal["packed", "padded"] = Field(
        "packed",
        description="How microbatches are built: 'packed' (sequences concatenated with cu_seqlens, no padding, "
        "attention through kernels.attention's registry, which refuses any backend that ignores sequence "
        "boundaries) or 'padded' (right-padded rows through the Hugging Face attention below).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa", description="Hugging Face attention implementation of the 'padded' layout (packed runs always use "
        "the registry's 'lockstep_packed')."
    )
    attention: AttentionPolicy = Field(
        default_factory=AttentionPolicy,
        description="Packed attention backend policy: force a backend by name, or require deterministic ones.",
    )
    mismatch_correction: MismatchCorrection = Field(
        default_factory=MismatchCorrection,
        description="Importance-sampling correction of the rollout/trainer mismatch: truncated (TIS) or masked "
        "(MIS) weights at token or sequence level, with a decoupled PPO ratio; 'none' keeps the rollout as the "
        "PPO old policy.",
    )
    lora: LoraSettings | None = Field(
        None,
        description="LoRA adapters on a frozen base (rank, alpha, dropout, target_modules, base_on_cpu): only the "
        "adapters are trained, checkpointed and sent at a weight sync. null = full fine-tune.",
    )
    numerics: Numerics = Field(
        "fast",
        description="'fast': the fastest kernels (log-probs agree with the rollout's up to rounding, checked by "
        "parity_gate's bounds). 'true_on_policy': the forward runs on batch-invariant kernels (every linear layer, "
        "RMSNorm, the 'batch_invariant' packed attention, the log-prob head), so a token's log-prob has the same "
        "bits whatever else shares its microbatch, and equals the bits of a rollout engine in the same mode: the "
        "step-1 gate then demands bitwise equality. Backward keeps torch's fast kernels. Needs batching 'packed'; "
        "refuses compile_layers and any other attention.backend.",
    )
    parity_gate: ParityThresholds = Field(
        default_factory=ParityThresholds,
        description="Step-1 parity gate: before the run's first update, trainer and rollout log-probs must agree "
        "within these bounds or the step is refused and the run fails with a diagnostic.",
    )

    objective: Literal["policy_gradient", "sft"] = Field(
        "policy_gradient", description="'policy_gradient': the policy loss above on the trajectories' advantages "
        "(RL and distillation runs). 'sft': the negative log-likelihood of the loss tokens (a supervised run's "
        "completion tokens), aggregated as loss_agg says; no parity gate (nothing was sampled). Set by the run "
        "spec's `kind`.",
    )
    teacher: TeacherSettings | None = Field(
        None, description="On-policy distillation: the teacher that scores every sampled token (set it with the run "
        "spec's top-level `teacher`, which the coordinator copies here). null = no teacher.",
    )

    # ---- mixture-of-experts (issue 40; contract/models/moe_settings.py) ----
    moe: MoeSettings = Field(default_factory=MoeSettings,
                             description="Mixture-of-experts options: auxiliary router losses and routing replay.")

    @model_validator(mode="after")
    def _moe_replay_is_for_fast(self) -> TrainerRunConfig:
        if self.moe.routing_replay and self.numerics == "true_on_policy":
            raise ValueError("moe.routing_replay: numerics 'true_on_policy' routes every token to the same experts "
                             "in rollout and trainer by construction; replay is for 'fast'")
        if self.moe.routing_replay and self.batching != "packed":
            raise ValueError(f"moe.routing_replay: needs batching 'packed' (the rollout's experts are laid out per "
                             f"packed position), got {self.batching!r}")
        return self

    @model_validator(mode="after")
    def _consistent_loss(self) -> TrainerRunConfig:
        if self.policy_loss.kind == "gspo" and "loss_agg" not in self.model_fields_set:
            # Resolved here, so the JSON the coordinator stores and sends names the aggregation trained with.
            self.loss_agg = "seq_mean_token_mean"
        if self.policy_loss.kind == "ppo_clip":
            try:
                check_bound_outside_clip("policy_loss.log_ratio_bound", self.policy_loss.log_ratio_bound,
                                         self.clip_eps_low, self.clip_eps_high)
            except ValueError as exc:
                raise ValueError(f"{exc} (clip_eps_low {self.clip_eps_low}, clip_eps_high {self.clip_eps_high})") \
                    from None
        correction, bound = self.mismatch_correction, self.policy_loss.log_ratio_bound
        if correction.mode != "none" and max(math.log(correction.upper), -math.log(correction.mask_lower)) >= bound:
            raise ValueError(
                f"policy_loss.log_ratio_bound: {bound} must exceed |log| of mismatch_correction's edges "
                f"(upper {correction.upper}, lower {correction.mask_lower}): log w is clamped to the bound before "
                "exp, which would otherwise move a weight across an edge")
        if self.policy_loss.kind == "gspo" and self.mismatch_correction.mode != "none":
            raise ValueError(
                f"policy_loss.kind: 'gspo' clips the sequence ratio against the PPO old policy, which with "
                f"mismatch_correction.mode {self.mismatch_correction.mode!r} is the trainer's own pre-update policy: "
                "that ratio is always 1 and the clip never acts. Use mismatch_correction.mode 'none' with gspo "
                "(or kind 'ppo_clip' with mismatch_correction.level 'geometric' for a sequence-level weight)")
        if (self.loss_agg == "seq_mean_token_sum_norm") != (self.loss_agg_tokens is not None):
            raise ValueError(
                "loss_agg_tokens: required by loss_agg 'seq_mean_token_sum_norm' (the constant each sequence's "
                f"token sum is divided by), and used by nothing else; loss_agg is {self.loss_agg!r} and "
                f"loss_agg_tokens is {self.loss_agg_tokens}")
        return self

    @model_validator(mode="after")
    def _consistent_objective(self) -> TrainerRunConfig:
        if self.objective == "sft" and self.teacher is not None:
            raise ValueError("teacher: a supervised (objective 'sft') run has no samples for a teacher to score")
        if self.objective == "sft" and self.kl_coef > 0:
            raise ValueError("kl_coef: the KL penalty is a policy-gradient term; objective 'sft' has none")
        return self

    @model_validator(mode="after")
    def _consistent_numerics(self) -> TrainerRunConfig:
        if self.numerics != "true_on_policy":
            return self
        if self.compile_layers:
            raise ValueError(
                "compile_layers: true is refused with numerics 'true_on_policy': torch.compile fuses the elementwise "
                "work around the batch-invariant kernels and changes its rounding, so the trainer's log-probs would "
                "no longer be the rollout's bits")
        if self.attention.backend not in (None, BATCH_INVARIANT_ATTENTION):
            raise ValueError(
                f"attention.backend: {self.attention.backend!r} conflicts with numerics 'true_on_policy', which runs "
                f"packed attention on the {BATCH_INVARIANT_ATTENTION!r} backend (leave attention.backend unset or "
                f"name {BATCH_INVARIANT_ATTENTION!r})")
        if self.batching != "packed":
            raise ValueError(
                f"batching: {self.batching!r} is refused with numerics 'true_on_policy': the padded layout runs "
                f"Hugging Face's {self.attn_implementation!r} attention, whose bits depend on the batch; use 'packed'")
        return self

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(betas):
            if not 0 <= b < 1:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        return betas


def format_validation_error(exc: ValidationError, *, prefix: str) -> str:
    """'prefix.field: reason; ...' — every error names its field, as INVALID_ARGUMENT messages must."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{loc}" if loc else prefix
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
