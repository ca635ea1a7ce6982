"""LoRA adapters as the rollout receives them: checked, grouped per module, merged or written in peft's layout.

A LoRA weight stream (WeightChunk.lora set) carries, for every adapted module
`m`, `base_model.model.<m>.lora_A.weight` [rank, in] and
`base_model.model.<m>.lora_B.weight` [out, rank] — peft's saved-adapter keys.
The embedded engine merges them into a pristine copy of the base it loaded,
W = W0 + (alpha / rank) * B @ A computed in float32 and cast to the engine's
dtype, so each version is applied to the same base and nothing accumulates;
SGLang gets them written as a peft adapter directory.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.weights.stream import LoraAdapterMeta

KEY_PREFIX = "base_model.model."
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class ModuleAdapter:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]


def split_key(key: str) -> tuple[str, str]:
    """(module name, 'lora_A' | 'lora_B') of a saved-adapter key; ValueError naming the key otherwise."""
    for part in ("lora_A", "lora_B"):
        suffix = f".{part}.weight"
        if key.startswith(KEY_PREFIX) and key.endswith(suffix) and len(key) > len(KEY_PREFIX) + len(suffix):
            return key[len(KEY_PREFIX): -len(suffix)], part
    raise ValueError(f"{key}: not a LoRA adapter tensor (base_model.model.<module>.lora_A|lora_B.weight)")


def module_adapters(tensors: dict[str, torch.Tensor], meta: LoraAdapterMeta) -> dict[str, ModuleAdapter]:
    """The stream's tensors per module, every one checked (pair complete, rank, finite, module in the
    adapter's targets); ValueError listing what is wrong, before anything is applied."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    problems: list[str] = []
    for key, t in tensors.items():
        try:
            module, part = split_key(key)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        parts.setdefault(module, {})[part] = t
        if t.dim() != 2:
            problems.append(f"{key}: expected a matrix, got shape {tuple(t.shape)}")
        elif (part == "lora_A" and t.shape[0] != meta.rank) or (part == "lora_B" and t.shape[1] != meta.rank):
            problems.append(f"{key}: shape {tuple(t.shape)} does not have rank {meta.rank}")
        elif not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            problems.append(f"{key}: not finite floating-point values")
        if module.rsplit(".", 1)[-1] not in meta.target_modules:
            problems.append(f"{key}: module {module!r} is not among lora.target_modules {list(meta.target_modules)}")
    for module, pair in parts.items():
        for part in ("lora_A", "lora_B"):
            if part not in pair:
                problems.append(f"{KEY_PREFIX}{module}.{part}.weight: missing")
    if not parts and not problems:
        problems.append("no adapter tensors in the stream")
    if problems:
        more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
        raise ValueError("weights: " + "; ".join(problems[:8]) + more)
    return {m: ModuleAdapter(a=p["lora_A"], b=p["lora_B"]) for m, p in parts.items()}


def merged_weight(base: torch.Tensor, adapter: ModuleAdapter, scale: float) -> torch.Tensor:
    """base + scale * B @ A, computed in float32 from `base` and cast to base's dtype."""
    delta = adapter.b.to(torch.float32) @ adapter.a.to(torch.float32)
    return (base.to(torch.float32) + scale * delta.to(base.device)).to(base.dtype)


def adapter_config(meta: LoraAdapterMeta, *, base_model_path: str) -> dict:
    """peft's adapter_config.json for this adapter (plain LoRA: no bias, no rsLoRA, no dropout)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": meta.rank,
        "lora_alpha": meta.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(meta.target_modules),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_model_path,
        "inference_mode": True,
    }


def write_peft_adapter(directory: Path, tensors: dict[str, torch.Tensor], meta: LoraAdapterMeta, *,
                       base_model_path: str) -> Path:
    """adapter_config.json + adapter_model.safetensors in `directory` (created), the layout peft and SGLang load."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config(meta, base_model_path=base_model_path),
                                                            indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS_FILE),
              metadata={"format": "pt"})
    return directory
