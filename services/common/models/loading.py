"""Loading Hugging Face causal LMs the same way in the trainer and the rollout engine.

Both sides must run the same model code with the same dtype and attention
implementation, or step-1 importance weights drift from 1 for reasons that have
nothing to do with learning (docs/DESIGN.md, "The invariant").
"""
from __future__ import annotations

from pathlib import Path

import torch

from services.common.models.directory import check_model_dir
from services.common.models.weight_files import check_weight_files, diagnose

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: unknown {name!r}, expected one of {sorted(DTYPES)}") from None


def load_causal_lm(
    path: str | Path,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path)
    check_weight_files(p)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(p), dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
        )
    except Exception as exc:
        # What the loaders raise for a bad file (a refused pickle, a corrupt header) names no file: the
        # file that does not load, found again with the same safe readers, is named instead.
        culprit = diagnose(p)
        if culprit is None:
            raise
        raise culprit from exc
    return model.to(device)
