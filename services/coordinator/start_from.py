"""A run that starts from another run's checkpoint (`start_from: {run, step}`): SFT, then RL, then distillation.

Resolved at submit, before the spec is validated: the named run's checkpoint directory (its last one, or
`step`'s) becomes the new run's `model_path`, and is then checked like any model path (inside the model
roots, a model directory; its tokenizer is the one the checkpoint copied). The spec is stored with both, so
the run loads exactly that directory. A LoRA run's checkpoint holds adapters alone and is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

from services.coordinator.run_spec import RunSpecError
from services.coordinator.state.store import RunStore, is_run_id

CHECKPOINTS = "checkpoints"
"""The run directory's folder of checkpoints (TrainerSession.checkpoint writes step_NNNNNN there)."""


def _refused(field: str, reason: str) -> RunSpecError:
    return RunSpecError([{"field": field, "reason": reason}])


async def resolve_start_from(body: bytes, store: RunStore, data_dir: Path) -> bytes:
    """`body` with model_path set from its start_from, or unchanged without one; RunSpecError naming the field.
    `body` is at most the spec size limit; a body that is not a JSON object is left for the spec's own checks."""
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(raw, dict) or raw.get("start_from") is None:
        return body
    start = raw["start_from"]
    if not isinstance(start, dict) or not isinstance(start.get("run"), str):
        raise _refused("start_from.run", "required: the id of the run whose checkpoint this run starts from")
    if "model_path" in raw:
        raise _refused("model_path", "set by start_from (the named run's checkpoint); leave it out")
    run_id, step = start["run"], start.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise _refused("start_from.step", f"{step!r} is not a step number (an integer >= 1)")
    if not is_run_id(run_id) or await store.get_run(run_id) is None:
        raise _refused("start_from.run", f"no run {run_id[:64]!r}")
    directory = data_dir / run_id / CHECKPOINTS
    saved = sorted(p for p in directory.glob("step_*") if p.is_dir()) if directory.is_dir() else []
    if step is not None:
        saved = [p for p in saved if p.name == f"step_{step:06d}"]
    if not saved:
        where = f"at step {step}" if step is not None else "yet"
        raise _refused("start_from.step" if step is not None else "start_from.run",
                       f"run {run_id} has no checkpoint {where}")
    chosen = saved[-1]
    if not (chosen / "config.json").is_file() or not any(chosen.glob("*.safetensors")) or \
            (chosen / "adapter_config.json").is_file():
        raise _refused("start_from.run", f"{chosen} is not a whole model (a LoRA run's checkpoint holds adapters "
                       "alone); start from the base model and the adapters' run is not supported")
    return json.dumps({**raw, "model_path": str(chosen)}).encode()
