"""LoRA on the trainer: a frozen base with low-rank adapters (through peft), trained, checkpointed and synced alone.

`trainer.lora` in the run spec turns it on (null: full fine-tune). The
adapters are injected in place into the Hugging Face model (peft's LoRA layers
replace the targeted `nn.Linear`s; the module tree and the policy around it
are unchanged), every base parameter is frozen, and only the adapters'
float32 masters are in the optimizer. FSDP2 shards frozen and trainable
parameters of one decoder layer in one unit: it gathers both, and reduces
gradients only for the parameters that have them.

Names: the model's own parameter names carry peft's adapter name
(`...q_proj.lora_A.default.weight`); what leaves the trainer (checkpoints,
weight syncs) uses peft's saved-adapter keys (`base_model.model....q_proj.lora_A.weight`),
the layout `PeftModel.from_pretrained` and SGLang's LoRA loader read.
"""
from __future__ import annotations

from collections.abc import Iterator
import torch

from contract.trainer_settings import LoraSettings
from services.common.weights.stream import LoraAdapterMeta

ADAPTER_NAME = "default"
PEFT_KEY_PREFIX = "base_model.model."
_PEFT_INSTALL_HINT = ("trainer.lora needs the peft package: `.venv/bin/pip install peft` "
                      "(the version pinned in requirements.lock)")


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is pinned; the hint is for a venv that lacks it
        raise RuntimeError(f"{_PEFT_INSTALL_HINT} ({exc})") from None
    return peft


def peft_config(settings: LoraSettings, *, base_model_path: str = ""):
    """peft's LoraConfig for these settings (adapter name `default`, no bias, plain alpha / rank scaling)."""
    peft = _peft()
    return peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=settings.target_modules if isinstance(settings.target_modules, str) else list(settings.target_modules),
        bias="none", use_rslora=False, init_lora_weights=True, task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path or None,
    )


def apply_lora(lm: torch.nn.Module, settings: LoraSettings, *, base_model_path: str = "") -> torch.nn.Module:
    """Inject adapters into `lm` in place and freeze everything else; returns `lm` (the same HF model).

    B starts at zero, so the adapted model computes exactly the base model until the first update. A
    target list that matches no linear layer of the model is a ValueError naming the field."""
    peft = _peft()
    try:
        peft.inject_adapter_in_model(peft_config(settings, base_model_path=base_model_path), lm, adapter_name=ADAPTER_NAME)
    except ValueError as exc:
        raise ValueError(f"target_modules: {exc}") from None
    _refuse_expert_adapters(lm)
    for name, p in lm.named_parameters():
        p.requires_grad_(is_adapter_param(name))
    if not any(p.requires_grad for p in lm.parameters()):
        raise ValueError("target_modules: no adapter was created in the model")
    return lm


def _refuse_expert_adapters(lm: torch.nn.Module) -> None:
    """LoRA on a mixture-of-experts model covers attention and dense layers only: an adapter inside an MoE
    block (a router, the routed or shared experts) is refused naming the module (docs/moe.md)."""
    blocks = [name for name, m in lm.named_modules() if type(m).__name__.endswith("SparseMoeBlock")]
    for name, module in lm.named_modules():
        if hasattr(module, "lora_A") and any(name.startswith(block + ".") for block in blocks):
            raise ValueError(f"target_modules: an adapter on {name} ({type(module.base_layer).__name__}) inside a "
                             "mixture-of-experts block; LoRA covers attention and dense layers only (name them)")


def is_adapter_param(name: str) -> bool:
    return f".lora_A.{ADAPTER_NAME}." in name or f".lora_B.{ADAPTER_NAME}." in name


def peft_key(param_name: str) -> str:
    """The saved-adapter key of a model parameter: `model.x.q_proj.lora_A.default.weight` ->
    `base_model.model.model.x.q_proj.lora_A.weight`."""
    if not is_adapter_param(param_name):
        raise ValueError(f"{param_name}: not a LoRA adapter parameter")
    return PEFT_KEY_PREFIX + param_name.replace(f".{ADAPTER_NAME}.", ".", 1)


def param_name(key: str) -> str:
    """Inverse of `peft_key`."""
    if not key.startswith(PEFT_KEY_PREFIX) or not (".lora_A." in key or ".lora_B." in key):
        raise ValueError(f"{key}: not a saved LoRA adapter key (base_model.model.<module>.lora_A|lora_B.weight)")
    rest = key[len(PEFT_KEY_PREFIX):]
    for part in (".lora_A.", ".lora_B."):
        if part in rest:
            return rest.replace(part, f"{part}{ADAPTER_NAME}.", 1)
    raise AssertionError("unreachable")


def adapted_modules(lm: torch.nn.Module) -> list[str]:
    """Names of the modules that carry an adapter, in module order."""
    suffix = f".lora_A.{ADAPTER_NAME}.weight"
    return [n[: -len(suffix)] for n, _ in lm.named_parameters() if n.endswith(suffix)]


def saved_adapter_config(lm: torch.nn.Module, settings: LoraSettings, *, base_model_path: str):
    """peft's LoraConfig to save beside the adapters: the adapted modules by their short names, so any peft
    (or SGLang) loader finds the same modules without resolving 'all-linear' itself."""
    explicit = settings.model_copy(update={"target_modules": list(adapter_meta(lm, settings).target_modules)})
    return peft_config(explicit, base_model_path=base_model_path)


def adapter_meta(lm: torch.nn.Module, settings: LoraSettings) -> LoraAdapterMeta:
    """What a receiver needs besides the tensors: rank, alpha and the short names of the adapted modules."""
    short = sorted({name.rsplit(".", 1)[-1] for name in adapted_modules(lm)})
    return LoraAdapterMeta(rank=settings.rank, alpha=settings.alpha, target_modules=tuple(short))


def named_adapter_tensors(lm: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(saved-adapter key, whole float32 master) of every adapter parameter, in module order. Collective."""
    from services.trainer.distributed.sharding import full_tensor

    for name, p in lm.named_parameters():
        if is_adapter_param(name):
            yield peft_key(name), full_tensor(p.detach())


def adapter_targets(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapter parameters by saved-adapter key (possibly sharded)."""
    return {peft_key(n): p for n, p in lm.named_parameters() if is_adapter_param(n)}


def check_adapter_weights(lm: torch.nn.Module, weights: dict[str, torch.Tensor], *, where: str) -> None:
    """Refuse adapter tensors that do not cover the model's adapters exactly (keys, whole shapes, dtypes)."""
    targets = adapter_targets(lm)
    problems = [f"{k}: not an adapter of the model" for k in weights if k not in targets]
    problems += [f"{k}: missing" for k in targets if k not in weights]
    for k, t in weights.items():
        if k in targets:
            if tuple(t.shape) != tuple(targets[k].shape):
                problems.append(f"{k}: shape {tuple(t.shape)} != model's {tuple(targets[k].shape)}")
            elif t.dtype != targets[k].dtype:
                problems.append(f"{k}: dtype {t.dtype} != model's {targets[k].dtype}")
    if problems:
        raise ValueError(f"{where}: adapter weights do not match the model: " + "; ".join(problems[:8]))


def load_adapter_tensors(lm: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy whole adapter tensors (saved-adapter keys, already checked) into the possibly sharded masters."""
    from services.trainer.distributed.sharding import load_master_tensors

    load_master_tensors(lm, {param_name(k): v for k, v in weights.items()})
