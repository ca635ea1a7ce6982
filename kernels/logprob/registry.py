"""Backend selection (minimal first version: reference only; the capability registry replaces it)."""
from __future__ import annotations

from types import SimpleNamespace

from kernels.logprob import reference

_REFERENCE = SimpleNamespace(
    name="reference", partials=reference.partials, merge=reference.merge, backward=reference.backward
)


def select_backend(name: str, *, logits, layout, temperature, tp_group, mask, with_entropy):
    if name == "auto" and layout.tp_world_size > 1:
        raise ValueError("backend='auto' is refused when TP > 1: every rank must name the same backend explicitly")
    if name == "reference" or (name == "auto" and logits.device.type == "cpu"):
        return _REFERENCE
    raise ValueError(f"logprob backend {name!r} is not available yet on {logits.device.type} (only 'reference')")
