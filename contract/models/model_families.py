"""Which Hugging Face model families a run may train, by `config.json` alone (no torch here: the
coordinator checks a run spec with it at submit).

Mixture-of-experts models are covered for the families whose router and experts kernels/moe implements
(docs/moe.md); any other MoE architecture is refused at submit, naming model_path and the architecture,
in either numerics mode, because the trainer's routing metrics, replay and expert-id checks are defined
for these blocks only. `true_on_policy` further needs a family make_batch_invariant covers.
"""
from __future__ import annotations

MOE_FAMILIES: tuple[str, ...] = ("qwen3_moe", "qwen2_moe")
"""model_type of the covered mixture-of-experts families (Qwen3-MoE; Qwen2-MoE with its shared expert)."""

BATCH_INVARIANT_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", *MOE_FAMILIES)
"""model_type values kernels/batch_invariant/hf.py patches (it checks every module as well)."""

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def describe(config: dict) -> str:
    """'model_type (architectures)' of a parsed config.json, for messages."""
    arch = config.get("architectures") or []
    return f"{config.get('model_type')!r} ({', '.join(map(str, arch)) or 'no architectures listed'})"


def is_moe(config: dict) -> bool:
    """The config describes a mixture-of-experts model (routed experts > 0)."""
    return any(isinstance(config.get(f), int) and config.get(f) > 0 for f in _EXPERT_FIELDS) \
        or config.get("model_type") in MOE_FAMILIES


def unsupported_reason(config: dict, numerics: str) -> str | None:
    """Why a run with this config.json cannot run in `numerics` (None: it can)."""
    model_type = config.get("model_type")
    if is_moe(config) and model_type not in MOE_FAMILIES:
        return (f"mixture-of-experts architecture {describe(config)} is not covered; covered MoE families: "
                f"{list(MOE_FAMILIES)}")
    if numerics == "true_on_policy" and model_type not in BATCH_INVARIANT_FAMILIES:
        return (f"architecture {describe(config)} has no batch-invariant implementation; numerics "
                f"'true_on_policy' covers {list(BATCH_INVARIANT_FAMILIES)}")
    return None
