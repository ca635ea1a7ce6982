"""Run a Hugging Face causal LM on the batch-invariant ops, in place, failing closed.

    from kernels.batch_invariant.hf import make_batch_invariant, BatchInvariantUnsupported
    make_batch_invariant(model)   # every nn.Linear -> bi_linear, every known RMSNorm -> bi_rms_norm

Only each module's `forward` changes (an instance attribute bound to the
module): parameters, buffers, module names and classes stay those of Hugging
Face, so state_dict keys, FSDP2 sharding, peft adapters, checkpoints and
weight syncs see the same model. Attention is not patched here: the trainer
forces the attention registry's `batch_invariant` backend, the rollout
decoder calls its own attention function.

Why the rest of the model needs no patch: embedding gathers, residual adds,
SiLU-and-mul, the rotary cos/sin (a K=1 product per position) and its
application are elementwise in eager mode, so a row's bits never depend on
the other rows. The rotary table itself is pinned to float32 (a
`model.to(bfloat16)` would round it, and then one side's cos/sin would not be
the other's). What is not elementwise — every matmul and every RMSNorm's
mean over the hidden size — is what the patch replaces.

Fail closed: every module of the model must be of a class on the allowlist
below, and the config must not ask for anything those classes would compute
outside the patched ops (sliding-window attention, scaled rotary variants,
mixture-of-experts routing outside the covered MoE families, Llama's
pretraining_tp split matmuls, attention dropout).

Mixture-of-experts (Qwen3-MoE, Qwen2-MoE with its shared expert): every
`*TopKRouter` runs `kernels.moe.hf_blocks.bi_router_forward` (bi_linear logits,
fixed-order float32 softmax, top-k with ties to the lowest expert index,
renormalisation in rank order) and every `*Experts` module
`bi_experts_forward` (tokens sorted by expert, one batch-invariant grouped GEMM
per projection, the top-k outputs combined in rank order in float32); the
SparseMoeBlock around them only calls children and elementwise ops, and
Qwen2-MoE's, whose shared-expert gate is a [T, 1] sigmoid, runs
`bi_shared_expert_block_forward` (the sigmoid off the CPU's scalar tail;
kernels/moe/rowwise.py, docs/moe.md). Anything else raises `BatchInvariantUnsupported` naming the module
path and class (or the config field) before a single forward ran.

peft LoRA layers are covered: their forward is `base_layer(x) +
lora_B(lora_A(dropout(x))) * scaling`, where base_layer, lora_A and lora_B are
nn.Linear (patched) and the rest is elementwise; a LoRA variant (DoRA...),
adapter dropout or embedding adapters are refused. Patch after injecting the
adapters (the call is idempotent and patches Linears added since).
"""
from __future__ import annotations

import types

import torch

from kernels.batch_invariant import bi_linear, bi_rms_norm
from kernels.moe import hf_blocks

# Modules whose own forward is row-invariant given patched children: containers, gathers,
# elementwise activations and the Hugging Face blocks of the supported families (their
# forwards only call children, elementwise torch ops and the attention interface).
_PLAIN_TORCH = frozenset({
    "torch.nn.modules.container.ModuleList",
    "torch.nn.modules.container.ModuleDict",
    "torch.nn.modules.container.ParameterDict",
    "torch.nn.modules.sparse.Embedding",
    "torch.nn.modules.linear.Identity",
    "torch.nn.modules.activation.SiLU",
    "transformers.activations.SiLUActivation",
})
_FAMILIES = {
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2"),
    "llama": ("transformers.models.llama.modeling_llama", "Llama"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2Moe"),
}
MOE_FAMILIES = frozenset({"qwen3_moe", "qwen2_moe"})
"""Families whose MoE blocks are covered: router and experts patched onto kernels/moe (docs/moe.md)."""
_BLOCKS = ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RotaryEmbedding",
           # MoE families: the block only calls its router, experts, shared expert and elementwise ops;
           # router and experts get the forwards of kernels/moe/hf_blocks.py.
           "SparseMoeBlock", "TopKRouter", "Experts")
_PEFT_LORA_LINEAR = "peft.tuners.lora.layer.Linear"
_HIDDEN_ACTS = frozenset({"silu"})

ALLOWED_MODULES: frozenset[str] = frozenset(
    _PLAIN_TORCH
    | {f"{mod}.{prefix}{block}" for mod, prefix in _FAMILIES.values() for block in _BLOCKS}
    | {_PEFT_LORA_LINEAR}
)
"""Qualified class names a batch-invariant model may contain besides nn.Linear and the RMSNorms."""

RMS_NORM_CLASSES: frozenset[str] = frozenset(f"{mod}.{prefix}RMSNorm" for mod, prefix in _FAMILIES.values())
"""RMSNorm classes whose forward is HF's `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`."""

_LINEAR = "torch.nn.modules.linear.Linear"


class BatchInvariantUnsupported(ValueError):
    """The model holds an op the batch-invariant mode does not cover; nothing was patched."""

    def __init__(self, where: str, what: str, reason: str) -> None:
        super().__init__(f"{where} ({what}): {reason}")
        self.where = where
        """Module path ('model.layers.0.mlp', '' for the root) or config field ('config.sliding_window')."""
        self.what = what
        """The module's qualified class name, or the config's value."""
        self.reason = reason


def qualified_name(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _bi_linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return bi_linear(input, self.weight, self.bias)


def _bi_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.weight.dtype != hidden_states.dtype:
        # HF would return weight-dtype values (`weight * normed.to(x.dtype)` promotes); the
        # batch-invariant op computes in x's dtype. Refused rather than silently different.
        raise BatchInvariantUnsupported(
            "RMSNorm", qualified_name(self),
            f"weight dtype {self.weight.dtype} != input dtype {hidden_states.dtype}; the batch-invariant "
            "RMSNorm needs both in the compute dtype")
    return bi_rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fp32_rotary_forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    if self.inv_freq.dtype != torch.float32:
        raise BatchInvariantUnsupported(
            "rotary embedding", qualified_name(self),
            f"inv_freq became {self.inv_freq.dtype} after make_batch_invariant (a model.to(dtype)?); both sides "
            "must compute cos/sin from the float32 table")
    return type(self).forward(self, x, position_ids)


def _pin_fp32_rotary_table(module: torch.nn.Module) -> None:
    """The cos/sin table in float32, as the config defines it: a `model.to(bfloat16)` casts the inv_freq
    buffer (from_pretrained(dtype=...) does not), and a rounded table gives other cos/sin bits than the
    other side's float32 one. Non-persistent buffers: no state_dict key changes."""
    if module.inv_freq.dtype == torch.float32 and module.original_inv_freq.dtype == torch.float32:
        return
    inv_freq, _scaling = module.compute_default_rope_parameters(module.config)
    device = module.inv_freq.device
    module.inv_freq = inv_freq.to(device)
    module.original_inv_freq = inv_freq.clone().to(device)


_PATCHED_FORWARDS = (_bi_linear_forward, _bi_rms_norm_forward, _fp32_rotary_forward, hf_blocks.bi_router_forward,
                     hf_blocks.bi_experts_forward, hf_blocks.bi_shared_expert_block_forward)


def is_patched(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) in _PATCHED_FORWARDS


def _check_config(config) -> None:
    def refuse(field: str, value, reason: str) -> None:
        raise BatchInvariantUnsupported(f"config.{field}", repr(value), reason)

    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        refuse("model_type", model_type, f"only {sorted(_FAMILIES)} models are covered")
    act = getattr(config, "hidden_act", "silu")
    if act not in _HIDDEN_ACTS:
        refuse("hidden_act", act, f"only {sorted(_HIDDEN_ACTS)} activations are covered")
    layer_types = list(getattr(config, "layer_types", None) or [])
    sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if sliding:
        refuse("layer_types", layer_types[sliding[0]],
               f"layer {sliding[0]} is not full attention (sliding-window attention is not covered: the "
               "batch-invariant attention kernels are causal over the whole sequence)")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        refuse("rope_parameters.rope_type", rope_type,
               "only the default rotary embedding is covered (scaled variants change the cos/sin tables per "
               "sequence length or attention scaling, not checked for batch invariance)")
    if model_type not in MOE_FAMILIES:
        for field in ("num_experts", "num_local_experts", "n_routed_experts"):
            if getattr(config, field, None):
                refuse(field, getattr(config, field), "mixture-of-experts routing is not covered")
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        refuse("pretraining_tp", config.pretraining_tp,
               "pretraining_tp > 1 splits the matmuls into F.linear calls outside nn.Linear")
    if getattr(config, "attention_dropout", 0.0):
        refuse("attention_dropout", config.attention_dropout, "attention dropout makes log-probs random")


def _check_module(path: str, module: torch.nn.Module) -> None:
    name = qualified_name(module)
    where = path or "(root)"
    if name == _LINEAR or name in RMS_NORM_CLASSES:
        return
    if name not in ALLOWED_MODULES:
        raise BatchInvariantUnsupported(
            where, name, "module class not on the batch-invariant allowlist (kernels/batch_invariant/hf.py); "
            "its forward may run ops whose bits depend on the batch")
    if name == _PEFT_LORA_LINEAR:
        base = qualified_name(module.base_layer)
        if base != _LINEAR:
            raise BatchInvariantUnsupported(where, name, f"LoRA on a {base} base layer (only nn.Linear is covered)")
        if getattr(module, "lora_variant", None):
            raise BatchInvariantUnsupported(
                where, name, f"LoRA variant {sorted(module.lora_variant)} (DoRA and other variants run their own "
                "matmuls); only plain LoRA is covered")
        if len(module.lora_embedding_A) or len(module.lora_embedding_B):
            raise BatchInvariantUnsupported(where, name, "embedding adapters are not covered")
    if name.endswith("Experts"):
        for flag in ("has_bias", "is_transposed"):
            if getattr(module, flag, False):
                raise BatchInvariantUnsupported(where, name, f"{flag}=True experts are not covered (kernels/moe takes "
                                                "bias-free [E, N, K] expert weights)")
        e, h = module.gate_up_proj.shape[0], module.gate_up_proj.shape[2]
        if module.gate_up_proj.shape[1] % 2 or tuple(module.down_proj.shape) != (e, h, module.gate_up_proj.shape[1] // 2):
            raise BatchInvariantUnsupported(where, name, f"expert weights gate_up_proj {tuple(module.gate_up_proj.shape)} "
                                            f"and down_proj {tuple(module.down_proj.shape)} are not [E, 2I, H] / [E, H, I]")
    if name.endswith("Attention") and getattr(module, "sliding_window", None) is not None:
        raise BatchInvariantUnsupported(where, name, f"sliding_window={module.sliding_window} is not covered")


def make_batch_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Patch `model` in place onto the batch-invariant ops; returns it. Idempotent.

    Raises BatchInvariantUnsupported (nothing patched) when a module class is not on the
    allowlist or the config asks for an op the mode does not cover."""
    config = getattr(model, "config", None)
    if config is None:
        raise BatchInvariantUnsupported("(root)", qualified_name(model), "not a Hugging Face model (no .config)")
    _check_config(config)
    modules = list(model.named_modules())
    for path, module in modules:
        _check_module(path, module)
    for _path, module in modules:
        name = qualified_name(module)
        if name.endswith("RotaryEmbedding"):
            _pin_fp32_rotary_table(module)
        if is_patched(module):
            continue
        if name == _LINEAR:
            module.forward = types.MethodType(_bi_linear_forward, module)
        elif name in RMS_NORM_CLASSES:
            module.forward = types.MethodType(_bi_rms_norm_forward, module)
        elif name.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_fp32_rotary_forward, module)
        elif name.endswith("TopKRouter"):
            module.forward = types.MethodType(hf_blocks.bi_router_forward, module)
        elif name.endswith("Experts"):
            module.forward = types.MethodType(hf_blocks.bi_experts_forward, module)
        elif name.endswith("SparseMoeBlock") and hasattr(module, "shared_expert_gate"):
            module.forward = types.MethodType(hf_blocks.bi_shared_expert_block_forward, module)
    hf_blocks.attach_states(model)
    return model
