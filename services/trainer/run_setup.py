"""Building a run's parts: its config, policy (float32 masters, sharded), reference model, optimizer,
and the one microbatch layout a step uses. Pure construction; the Trainer holds what these return."""
from __future__ import annotations

from pathlib import Path

import torch
from pydantic import ValidationError

from contract.models.model_families import MOE_FAMILIES
from contract.trainer_run import TrainerRunConfig, format_validation_error
from contract.trainer_settings import BATCH_INVARIANT_ATTENTION, AttentionPolicy
from services.common.models.loading import load_causal_lm, resolve_dtype
from services.trainer import checkpoint as ckpt
from services.trainer.data.batching import Microbatch, TrainSample, canonical_order, padded_microbatches
from services.trainer.data.packing import PackingConfig, pack_samples
from services.trainer.data.wire import InvalidRequest
from services.trainer.distributed import sharding
from services.trainer.model import lora
from services.trainer.model.policy import PolicyModule


def parse_run_config(text: str) -> TrainerRunConfig:
    try:
        return TrainerRunConfig.model_validate_json(text or "{}")
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc, prefix="trainer_config_json")) from None


def attn_implementation(config: TrainerRunConfig) -> str:
    if config.batching == "packed":
        # Packed microbatches only ever reach attention through the registry,
        # which refuses backends that ignore cu_seqlens.
        from kernels.attention import register_hf_attention

        return register_hf_attention()
    return config.attn_implementation


def attention_policy(config: TrainerRunConfig) -> AttentionPolicy:
    """The attention registry policy of a run: its own, with the backend forced in true_on_policy (the
    config refuses another explicit backend there)."""
    if config.numerics == "true_on_policy":
        return config.attention.model_copy(update={"backend": BATCH_INVARIANT_ATTENTION})
    return config.attention


def apply_numerics(model: torch.nn.Module, config: TrainerRunConfig) -> torch.nn.Module:
    """In true_on_policy, patch the model onto the batch-invariant ops (idempotent: called again after
    LoRA injects its adapter Linears); in fast mode the model is left alone."""
    if config.numerics != "true_on_policy":
        if getattr(model.config, "model_type", None) in MOE_FAMILIES:
            # HF's router math, recorded for the routing metrics and open to replay (kernels/moe/hf_blocks.py).
            from kernels.moe.hf_blocks import observe_routing

            observe_routing(model)
        return model
    from kernels.batch_invariant.hf import BatchInvariantUnsupported, make_batch_invariant

    try:
        return make_batch_invariant(model)
    except BatchInvariantUnsupported as exc:
        raise InvalidRequest(f"trainer_config_json.numerics: 'true_on_policy' cannot run this model: {exc}") from None


def check_moe_settings(model: torch.nn.Module, config: TrainerRunConfig) -> None:
    """trainer.moe options need routers to act on: refused for a dense model, naming the field."""
    if getattr(model.config, "model_type", None) in MOE_FAMILIES:
        return
    for field, value in config.moe.model_dump().items():
        if value:
            raise InvalidRequest(f"trainer_config_json.moe.{field}: the model "
                                 f"({getattr(model.config, 'model_type', None)!r}) has no mixture-of-experts layers")


def load_model(path: str | Path, config: TrainerRunConfig, device: str, *, dtype: str,
                field_name: str) -> torch.nn.Module:
    try:
        model = load_causal_lm(path, dtype=dtype, device=device, attn_implementation=attn_implementation(config))
    except FileNotFoundError as exc:
        raise InvalidRequest(f"{field_name}: {str(exc).removeprefix('model_path: ')}") from None
    # eval(): no dropout. The update must score tokens with exactly the
    # function the rollout engine sampled from, or step-1 IW drifts from 1;
    # gradients flow in eval mode all the same.
    model.eval()
    check_moe_settings(model, config)
    return apply_numerics(model, config)


def load_reference(model_path: str, config: TrainerRunConfig, device: str) -> PolicyModule:
    """The KL reference: the run's initial policy, frozen, whole, in the compute dtype (the same cast of
    the same masters the policy computes with at step 1), scored with the run's numerics."""
    ref = PolicyModule(load_model(model_path, config, device, dtype=config.dtype, field_name="model_path"),
                       numerics=config.numerics)
    ref.requires_grad_(False)
    return ref


def load_policy(path: str | Path, config: TrainerRunConfig, device: torch.device, *, field_name: str) -> PolicyModule:
    """float32 masters loaded on the CPU, then sharded onto `device` (each rank keeps its 1/N)."""
    lm = load_model(path, config, "cpu", dtype="float32", field_name=field_name)
    return _sharded(lm, config, device)


def load_run_policy(model_path: str, resume_checkpoint: str, config: TrainerRunConfig,
                    device: torch.device) -> PolicyModule:
    """The run's policy: from the checkpoint when resuming, else from the model.

    A LoRA run always loads its base from `model_path` (its checkpoints hold the adapters alone), injects
    the adapters and, when resuming, loads their masters from the checkpoint before sharding."""
    if config.lora is None:
        if resume_checkpoint:
            return load_policy(resume_checkpoint, config, device, field_name="resume_checkpoint")
        return load_policy(model_path, config, device, field_name="model_path")
    if config.lora.base_on_cpu and device.type == "cpu":
        raise InvalidRequest(f"trainer_config_json.lora.base_on_cpu: the trainer runs on device {device.type!r}, "
                             "where the base weights already live in CPU memory; base_on_cpu needs an accelerator")
    lm = load_model(model_path, config, "cpu", dtype="float32", field_name="model_path")
    try:
        lora.apply_lora(lm, config.lora, base_model_path=model_path)
    except ValueError as exc:
        raise InvalidRequest(f"trainer_config_json.lora.{exc}") from None
    apply_numerics(lm, config)  # the adapters' own Linears
    if resume_checkpoint:
        try:
            weights = ckpt.load_adapter_weights(resume_checkpoint)
            lora.check_adapter_weights(lm, weights, where=ckpt.ADAPTER_WEIGHTS_FILE)
        except (FileNotFoundError, ValueError) as exc:
            raise InvalidRequest(f"resume_checkpoint: {exc}") from None
        lora.load_adapter_tensors(lm, weights)
    return _sharded(lm, config, device)


def _sharded(lm: torch.nn.Module, config: TrainerRunConfig, device: torch.device) -> PolicyModule:
    policy = PolicyModule(lm, numerics=config.numerics)
    base_on_cpu = config.lora is not None and config.lora.base_on_cpu
    sharding.shard_policy(policy, lm, device, sharding.ShardingPlan(
        compute_dtype=resolve_dtype(config.dtype), activation_checkpointing=config.activation_checkpointing,
        compile_layers=config.compile_layers, cpu_offload=config.optimizer_offload or base_on_cpu))
    return policy


def build_optimizer(model: torch.nn.Module, config: TrainerRunConfig, device: torch.device) -> torch.optim.Optimizer:
    # On an accelerator one fused kernel updates every shard (elementwise, deterministic); on the
    # CPU, and for offloaded state, torch's default implementation.
    offloaded = config.optimizer_offload or (config.lora is not None and config.lora.base_on_cpu)
    fused = device.type == "cuda" and not offloaded
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def build_microbatches(samples: list[TrainSample], config: TrainerRunConfig) -> list[Microbatch]:
    """The one place that picks a microbatch layout. Both index samples in canonical order."""
    if config.batching == "packed":
        try:
            return pack_samples(canonical_order(samples), PackingConfig(token_budget=config.microbatch_tokens))
        except ValueError as exc:
            raise InvalidRequest(f"trajectories: {exc}") from None
    if config.batching == "padded":
        return padded_microbatches(samples, config.microbatch_tokens)
    raise InvalidRequest(f"trainer_config_json.batching: {config.batching!r} is not implemented")

