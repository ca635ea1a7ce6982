"""The run-spec models nested in `trainer` (TrainerRunConfig): pydantic only, no torch.

The coordinator validates a run spec with these models at submit time and the
trainer validates ConfigureRun's JSON with the same ones, so both refuse a bad
value with the same field name and message. The trainer modules that act on
each setting (services/trainer/loss/lr_schedule.py, mismatch_correction.py,
parity_gate.py, policy_loss.py, lora.py; kernels/attention/registry.py for
AttentionPolicy) import it from here.
"""
from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

LossAggregation = Literal["token_mean", "seq_mean_token_sum_norm", "seq_mean_token_mean"]

Numerics = Literal["fast", "true_on_policy"]
"""How forward numerics are chosen: 'fast' (the fastest kernels; trainer and rollout agree up to rounding)
or 'true_on_policy' (batch-invariant kernels on both sides, so a token's log-prob has the same bits in the
rollout and in the trainer's recompute). One name and literal in the trainer, the engine and the run spec."""

BATCH_INVARIANT_ATTENTION = "batch_invariant"
"""The attention registry backend true_on_policy runs packed attention on (kernels/attention/registry.py)."""

DEFAULT_M2PO_THRESHOLD = 0.04
DEFAULT_GSPO_CLIP_LOW = 3e-4
DEFAULT_GSPO_CLIP_HIGH = 4e-4
DEFAULT_LOG_RATIO_BOUND = 20.0
"""Token log-ratios are clamped to +-this before exp (verl's bound for the PPO ratio and the k3 KL)."""
DEFAULT_GSPO_LOG_RATIO_BOUND = 10.0
"""GSPO's sequence log-ratio is clamped to +-this before exp (verl clamps it above at 10)."""
MAX_LOG_RATIO_BOUND = 40.0
"""Largest bound a spec may set: e^40 = 2.4e17, so a bounded ratio times an advantage, summed over a step's
tokens, stays many orders of magnitude below float32's overflow at e^88.7."""

_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class LRSchedule(BaseModel):
    """How the learning rate moves with the step; the default keeps it at `lr` exactly."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    warmup_steps: int = Field(
        0, ge=0,
        description="Linear warmup length: step s <= warmup_steps uses lr * s / warmup_steps, so step 1 "
        "uses lr / warmup_steps and step warmup_steps uses lr (0 = no warmup).")
    decay: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Shape after warmup: 'constant' stays at lr; 'linear' and 'cosine' go from lr at "
        "step warmup_steps down to lr * min_lr_ratio at step decay_steps and stay there.")
    decay_steps: int | None = Field(
        None, ge=1,
        description="The step at which 'linear' or 'cosine' decay reaches its floor (required by them, "
        "refused with 'constant'); must be greater than warmup_steps.")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1,
        description="Floor of the decay as a fraction of lr (only with 'linear' or 'cosine').")
    staleness_scaling: Literal["none", "inverse"] = Field(
        "none",
        description="'inverse': a step whose model tokens were sampled on average tau policy versions behind "
        "the trainer trains at the schedule's lr / max(1, tau) (staleness-aware SGD), so fixed_lag "
        "max_staleness 1 keeps the rate and 2 halves it once the lag is full. Needs async.max_staleness >= 2, "
        "below which it changes nothing. 'none': the rate ignores staleness.")

    @model_validator(mode="after")
    def _consistent(self) -> LRSchedule:
        # A field that the chosen shape would ignore is refused rather than
        # silently dropped: a user who set it expected it to do something.
        if self.decay == "constant":
            if self.decay_steps is not None:
                raise ValueError(f"decay_steps: {self.decay_steps} is set but decay is 'constant' "
                                 "(set decay to 'linear' or 'cosine', or drop decay_steps)")
            if self.min_lr_ratio != 0.0:
                raise ValueError(f"min_lr_ratio: {self.min_lr_ratio} is set but decay is 'constant' "
                                 "(set decay to 'linear' or 'cosine', or drop min_lr_ratio)")
            return self
        if self.decay_steps is None:
            raise ValueError(f"decay_steps: required when decay is {self.decay!r}")
        if self.warmup_steps >= self.decay_steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} must be less than decay_steps "
                             f"({self.decay_steps})")
        return self


class MismatchCorrection(BaseModel):
    """How token losses are reweighted for the rollout/trainer mismatch; the default changes nothing."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    mode: Literal["none", "truncate", "mask"] = Field(
        "none",
        description="'none': PPO ratio against the rollout's log-probs (no correction). 'truncate': decoupled "
        "ratio, loss weighted by min(w, upper). 'mask': decoupled ratio, loss weighted by w inside "
        "[lower, upper] and 0 outside.")
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Where w = pi_train / pi_rollout is measured: per token, per sequence (product over its "
        "response tokens), or per sequence as the geometric mean (length-normalised).")
    upper: float = Field(2.0, gt=1, description="Upper bound of w (truncation cap, or mask upper edge).")
    lower: float | None = Field(
        None, gt=0, lt=1, description="Lower edge of the mask (mode 'mask' only; default 1 / upper).")

    @model_validator(mode="after")
    def _consistent(self) -> MismatchCorrection:
        if self.lower is not None and self.mode != "mask":
            raise ValueError(f"lower: only used by mode 'mask', but mode is {self.mode!r}")
        if self.mode == "none" and (self.level != "token" or self.upper != 2.0):
            raise ValueError("mode: 'none' ignores level and upper; set mode to 'truncate' or 'mask', or drop them")
        return self

    @property
    def mask_lower(self) -> float:
        return self.lower if self.lower is not None else 1.0 / self.upper


class ParityThresholds(BaseModel):
    """Bounds on trainer/rollout disagreement at step 1 (part of the run spec)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    iw_mean_tolerance: float = Field(
        1e-3, ge=0,
        description="Largest allowed |mean(IW) - 1| over response tokens, IW = exp(logp - rollout_logp). "
        "Seed 000: 0.9996 with varlen attention (passes), 0.41 with boundary-blind SDPA (fails).")
    iw_max: float = Field(
        3.0, gt=1,
        description="Largest allowed single-token IW. One token far above it means the trainer assigns much "
        "more probability than the sampler did: a numerics or masking bug concentrated somewhere.")
    logprob_abs_diff_mean: float = Field(
        0.03, ge=0,
        description="Largest allowed mean |logp - rollout_logp| over response tokens (0.03; a healthy Qwen3-4B LoRA run on MI355X averaged 0.0123).")
    worst_tokens: int = Field(
        8, ge=0, le=1000,
        description="How many tokens with the largest |logp - rollout_logp| the diagnostic lists.")


class PolicyLoss(BaseModel):
    """Which policy-gradient objective a step minimises; the default is the PPO-clip loss."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, strict=True)

    kind: Literal["ppo_clip", "gspo", "m2po"] = Field(
        "ppo_clip",
        description="'ppo_clip': token-level PPO-clip with trainer.clip_eps_low/high. 'gspo': GSPO (Zheng et al. "
        "2025), sequence-level ratio exp(mean_t(logp - old_logp)) clipped per sequence to [1 - gspo_clip_low, "
        "1 + gspo_clip_high]. 'm2po': M2PO (Zheng et al. 2025), the tokens with the largest (logp - rollout_logp)^2 "
        "are masked until the kept tokens' mean is <= m2po_threshold; kept tokens use the unclipped ratio.")
    m2po_threshold: float = Field(
        DEFAULT_M2PO_THRESHOLD, gt=0, le=1e6,
        description="M2PO bound on the mean (logp - rollout_logp)^2 of the tokens kept in the loss "
        "(kind 'm2po' only; 0.04 as in the paper and AReaL).")
    gspo_clip_low: float = Field(
        DEFAULT_GSPO_CLIP_LOW, ge=0, lt=1,
        description="GSPO: sequence ratios below 1 - gspo_clip_low stop contributing gradient (kind 'gspo' only; "
        "the paper's 3e-4).")
    gspo_clip_high: float = Field(
        DEFAULT_GSPO_CLIP_HIGH, ge=0, le=100.0,
        description="GSPO: sequence ratios above 1 + gspo_clip_high stop contributing gradient (kind 'gspo' only; "
        "the paper's 4e-4).")
    log_ratio_bound: float = Field(
        DEFAULT_LOG_RATIO_BOUND, gt=0, le=MAX_LOG_RATIO_BOUND,
        description="Token log-ratios are clamped to [-log_ratio_bound, log_ratio_bound] before exp: logp - old_logp "
        "of kinds 'ppo_clip' and 'm2po', and the KL term's log(ref / policy) under every kind (20, as verl). A clamped "
        "token's ratio is a constant (no gradient through it), and the step counts it in log_ratio_clamped_tokens. "
        "Must lie outside the PPO clip range, log(1 - clip_eps_low) .. log(1 + clip_eps_high).")
    gspo_log_ratio_bound: float = Field(
        DEFAULT_GSPO_LOG_RATIO_BOUND, gt=0, le=MAX_LOG_RATIO_BOUND,
        description="GSPO: each sequence's log-ratio mean_t(logp - old_logp) is clamped to [-gspo_log_ratio_bound, "
        "gspo_log_ratio_bound] before exp (kind 'gspo' only; 10, verl's upper bound, which leaves the lower side open). "
        "A clamped sequence carries no gradient and its tokens count in log_ratio_clamped_tokens. Must lie outside "
        "the GSPO clip range, log(1 - gspo_clip_low) .. log(1 + gspo_clip_high).")

    @model_validator(mode="after")
    def _no_unused_settings(self) -> PolicyLoss:
        if self.kind != "m2po" and self.m2po_threshold != DEFAULT_M2PO_THRESHOLD:
            raise ValueError(f"m2po_threshold: only used by kind 'm2po', but kind is {self.kind!r}")
        if self.kind != "gspo":
            for name, default in (("gspo_clip_low", DEFAULT_GSPO_CLIP_LOW), ("gspo_clip_high", DEFAULT_GSPO_CLIP_HIGH),
                                  ("gspo_log_ratio_bound", DEFAULT_GSPO_LOG_RATIO_BOUND)):
                if getattr(self, name) != default:
                    raise ValueError(f"{name}: only used by kind 'gspo', but kind is {self.kind!r}")
        if self.kind == "gspo":
            check_bound_outside_clip("gspo_log_ratio_bound", self.gspo_log_ratio_bound,
                                     self.gspo_clip_low, self.gspo_clip_high)
        return self


def check_bound_outside_clip(name: str, bound: float, clip_low: float, clip_high: float) -> None:
    """Refuse a log-ratio bound inside the clip range [log(1 - low), log(1 + high)]: the clamp would take the
    gradient of ratios the clip keeps, and a clamped ratio inside the range changes the loss itself."""
    edge = max(math.log1p(clip_high), -math.log1p(-clip_low))
    if bound <= edge:
        raise ValueError(f"{name}: {bound} lies inside the clip range (the clip reaches log-ratio {edge:.6g}); "
                         "the bound must exceed it, or the clamp would change ratios the clip keeps")


class LoraSettings(BaseModel):
    """LoRA adapters on a frozen base (`trainer.lora`; null = full fine-tune)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    rank: int = Field(..., ge=1, le=1024, description="Rank r of every adapter (A: r x in, B: out x r).")
    alpha: float = Field(..., gt=0, le=1e6, description="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the adapters' input. Only 0 is accepted: the trainer scores tokens in eval mode so "
        "that its log-probs are the function the rollout sampled from, and dropout would make them differ.",
    )
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: 'all-linear' (every linear layer but the output head) or a list of "
        "module names matched as peft matches them (a name equal to the module path's last part: q_proj, up_proj...).",
    )
    base_on_cpu: bool = Field(
        False,
        description="Keep the frozen base weights (and, FSDP2 offloading whole units, the adapters' masters and "
        "AdamW state) in CPU memory, copied to the accelerator one decoder layer at a time. Needs an accelerator.",
    )

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, v: float) -> float:
        if v != 0:
            raise ValueError(f"only 0 is supported, got {v}: the update scores tokens in eval mode (no dropout) so "
                             "that its log-probs are those the rollout sampled with")
        return v

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("must be 'all-linear' or a non-empty list of module names")
        if len(v) > 64:
            raise ValueError(f"at most 64 module names, got {len(v)}")
        for i, name in enumerate(v):
            if not _MODULE_NAME.match(name):
                raise ValueError(f"[{i}]: {name!r} is not a module name (letters, digits, underscores)")
        if len(set(v)) != len(v):
            raise ValueError("names must be distinct")
        return v

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class AttentionPolicy(BaseModel):
    """How the trainer (or a user) constrains backend selection. Part of a run's spec."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str | None = Field(
        None,
        description="Force this registered backend by name (e.g. 'torch_varlen', 'reference'). "
        "None selects automatically by priority. A forced backend that cannot serve a call raises; "
        "it is never replaced by another.",
    )
    require_deterministic: bool | None = Field(
        None,
        description="Only backends that declare bitwise-reproducible forward+backward. None follows "
        "torch.are_deterministic_algorithms_enabled(), so a run in deterministic mode cannot pick a "
        "non-deterministic attention by accident.",
    )



# ------------------------------------------------------------ on-policy distillation --

MAX_TEACHER_PATH_LENGTH = 4096
"""Longest teacher model path a spec may name (Linux's PATH_MAX, as the run's own model_path)."""


class TeacherSettings(BaseModel):
    """On-policy distillation (the run spec's top-level `teacher`; docs/distillation.md).

    The student samples; the teacher scores exactly the sampled tokens, and each token's advantage is
    kl_weight * (the discounted sum of teacher logp - student logp from that token on) + reward_weight *
    the task's GRPO advantage of its sequence. The student's log-prob is the rollout's (the behaviour
    policy's), so no extra student pass is needed."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    model_path: str = Field(..., min_length=1, max_length=MAX_TEACHER_PATH_LENGTH,
                            description="Hugging Face causal-LM directory of the teacher, inside the operator's "
                            "model roots (the coordinator's and the trainer's). Its tokenizer must be the "
                            "student's, token for token.")
    placement: Literal["trainer"] = Field(
        "trainer", description="Where the teacher runs: 'trainer' loads it beside the student in the trainer "
        "service (whole, frozen, in the run's compute dtype and numerics) and scores each step's packed "
        "microbatches with it before the update.")
    kl_weight: float = Field(1.0, ge=0, le=1e3, description="Weight of the per-token reverse-KL advantage "
                             "(teacher logp - student logp).")
    reward_weight: float = Field(0.0, ge=0, le=1e3, description="Weight of the task's GRPO advantage (the "
                                 "sequence's, on each of its tokens); 0 = pure distillation.")
    discount: float = Field(0.0, ge=0, le=1, description="gamma of the reverse-KL return: a token's advantage is "
                            "sum over later tokens k of gamma^(k-t) (teacher - student)_k; 0 = each token's own "
                            "log-ratio (the usual on-policy distillation).")

    @field_validator("reward_weight")
    @classmethod
    def _some_signal(cls, v: float, info) -> float:
        if v == 0 and info.data.get("kl_weight") == 0:
            raise ValueError("kl_weight and reward_weight are both 0, so every advantage would be 0; set kl_weight "
                             "> 0 (distillation) or drop the teacher")
        return v
