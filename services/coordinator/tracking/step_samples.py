"""Every sample a step trained on, kept readable: `<run dir>/samples/step_NNNNNN.json`.

The trainer input of a step is otherwise kept only when the run asks for it (debug.record_trajectories,
for replay) or while a fixed-lag rollout waits for its step (state/kept_rollouts.py), so "what did the
policy write at step s" had no answer. Each step's trajectories are written here as they are sent to the
trainer, with the prompt and response decoded by the run's tokenizer, and only the last `keep_steps`
steps, and at most `keep_bytes` of them, are kept (a run of a million steps must not fill the disk with
samples); the newest step always is.

Pure file I/O and dicts: the run loop writes (off the event loop), the REST API reads and pages.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from contract.wire_tensors import array_from_proto
from proto import lockstep_pb2 as pb

ORDERS = ("record", "worst", "best")
"""How a page of samples is ordered: as trained, lowest reward first, highest reward first."""


def samples_path(run_dir: Path, step: int) -> Path:
    return run_dir / "samples" / f"step_{step:06d}.json"


def sample_view(index: int, t: pb.Trajectory, decode: Callable[[Sequence[int]], str],
                iw: tuple[float, float] | None = None) -> dict:
    """One trajectory as the samples API shows it. Floats are the trajectory's own float32 values, widened
    to float64 exactly, so they equal the step record's bit for bit. `iw`: the (smallest, largest)
    importance weight the trainer measured over its tokens (None: not reported, as for a replayed step)."""
    prompt = array_from_proto(t.prompt_token_ids, field="prompt_token_ids").tolist() if t.prompt_token_ids.shape \
        else []
    response = array_from_proto(t.response_token_ids, field="response_token_ids").tolist() \
        if t.response_token_ids.shape else []
    versions = list(t.token_policy_versions) or [t.policy_version]
    return {
        "index": index, "sample_id": t.sample_id, "group_id": t.group_id,
        "prompt": decode(prompt), "response": decode(response),
        "prompt_token_ids": prompt, "response_token_ids": response,
        "reward": float(t.reward), "advantage": float(t.advantage),
        "length": len(response), "finish_reason": t.finish_reason,
        "policy_version": int(min(versions)), "policy_version_last": int(max(versions)),
        "iw_min": iw[0] if iw else None, "iw_max": iw[1] if iw else None,
    }


class StepSamples:
    """The last `keep_steps` steps' samples of one run, at most `keep_bytes` of them, under `run_dir/samples/`."""

    def __init__(self, run_dir: Path, keep_steps: int, decode: Callable[[Sequence[int]], str], *,
                 keep_bytes: int = 1 << 30) -> None:
        self.run_dir, self.keep_steps, self.decode, self.keep_bytes = run_dir, keep_steps, decode, keep_bytes

    def put(self, step: int, trajectories: Iterable[pb.Trajectory],
            weights: dict[str, tuple[float, float]] | None = None) -> Path | None:
        """Write step `step`'s samples (whole or not at all: temp file and rename), each with its IW range
        from `weights` (sample id -> (min, max)), then forget the steps that fell out of the window.
        Blocking: call it off the event loop. None when keep_steps is 0."""
        if self.keep_steps == 0:
            return None
        path = samples_path(self.run_dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        weights = weights or {}
        views = [sample_view(i, t, self.decode, weights.get(t.sample_id)) for i, t in enumerate(trajectories)]
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"step": step, "samples": views}))
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half-written file behind
            raise
        self._forget_old(step)
        return path

    def _forget_old(self, step: int) -> None:
        """Forget the steps before the window of keep_steps ending at `step`, then the oldest until the rest
        fit keep_bytes (the newest one always stays)."""
        kept, total = 0, 0
        for old in reversed(path_steps(self.run_dir)):
            path = samples_path(self.run_dir, old)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            total += size
            if kept and (old <= step - self.keep_steps or total > self.keep_bytes):
                path.unlink(missing_ok=True)
            else:
                kept += 1


def path_steps(run_dir: Path) -> list[int]:
    """The steps whose samples are kept, ascending."""
    folder = run_dir / "samples"
    if not folder.is_dir():
        return []
    steps = []
    for p in folder.glob("step_*.json"):
        digits = p.name[len("step_"):-len(".json")]
        if digits.isdigit():
            steps.append(int(digits))
    return sorted(steps)


def read_samples(run_dir: Path, step: int) -> list[dict] | None:
    """Step `step`'s samples in record order; None if they are not kept (not reached, or out of the window)."""
    path = samples_path(run_dir, step)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return doc["samples"]


def page(samples: list[dict], *, order: str = "record", group: str | None = None, offset: int = 0,
         limit: int = 100) -> tuple[int, list[dict]]:
    """(how many match, the page): samples of `group` (all when None) in `order`, `limit` from `offset`.
    Ties keep record order, so a page is a function of the step's samples alone."""
    if order not in ORDERS:
        raise ValueError(f"order: {order!r} is not one of {ORDERS}")
    chosen = [s for s in samples if group is None or s["group_id"] == group]
    if order == "worst":
        chosen.sort(key=lambda s: (s["reward"], s["index"]))
    elif order == "best":
        chosen.sort(key=lambda s: (-s["reward"], s["index"]))
    return len(chosen), chosen[offset:offset + limit]
