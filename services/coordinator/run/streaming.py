"""Streaming asynchronous RL, the arithmetic (pure; no I/O).

In `async.mode: streaming` the replicas generate continuously: a sequence in flight when new weights
arrive is paused at a token boundary and continued under them, so its tokens' versions rise along it.
A trajectory is admitted to step s only if every token's version lies in [s - 1 - K, s - 1] (the
trainer holds s - 1): a hard per-trajectory bound on each token, not a queue size. Others are dropped
before training and counted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from contract.wire_tensors import array_from_proto as from_proto
from proto import lockstep_pb2 as pb
from services.coordinator.run.fixed_lag import behaviour_version


def token_versions(t: pb.Trajectory) -> list[int]:
    """The version of each response token (every token at policy_version when none are listed)."""
    if t.token_policy_versions:
        return list(t.token_policy_versions)
    return [t.policy_version] * from_proto(t.response_token_ids, field="response_token_ids").size


def admitted(step: int, versions: Sequence[int], max_staleness: int) -> bool:
    """Whether a trajectory of `versions` (one per token) may train step `step`."""
    lowest = behaviour_version(step, max_staleness)
    return bool(versions) and all(lowest <= v <= step - 1 for v in versions)


def admit(step: int, trajectories: Sequence[pb.Trajectory],
          max_staleness: int) -> tuple[list[pb.Trajectory], int]:
    """The trajectories step `step` may train on, in order, and how many were dropped as out of bound."""
    kept = [t for t in trajectories if admitted(step, token_versions(t), max_staleness)]
    return kept, len(trajectories) - len(kept)


def nearest_rank(sorted_values: Sequence[int], q: float) -> int:
    """The q-quantile (0 < q <= 1) of ascending `sorted_values` by the nearest-rank rule."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def token_staleness_metrics(step: int, trajectories: Sequence[pb.Trajectory]) -> dict[str, float]:
    """p50/p95/max over every trained response token of step - 1 - its version."""
    stale = sorted(step - 1 - v for t in trajectories for v in token_versions(t))
    if not stale:
        raise ValueError(f"step {step}: no tokens")
    return {"token_staleness_p50": float(nearest_rank(stale, 0.5)),
            "token_staleness_p95": float(nearest_rank(stale, 0.95)),
            "token_staleness_max": float(stale[-1])}


def merge_round(done: dict[str, pb.Sample], paused: dict[str, pb.Sample], got: Sequence[pb.Sample]) -> None:
    """Fold one Generate round of a streamed rollout into its finished and paused samples.

    A sample finished earlier stays as it was (a later round asks only for the samples still missing, and
    any other answer for a finished one is ignored). A paused sample with tokens is continued next round;
    one paused before its first token starts again."""
    for s in got:
        if s.sample_id in done:
            continue
        if s.finish_reason == "paused":
            if s.policy_versions:
                paused[s.sample_id] = s
            else:
                paused.pop(s.sample_id, None)
        else:
            done[s.sample_id] = s
            paused.pop(s.sample_id, None)
