"""Per-token policy versions of a TrainStep: the staleness bound the trainer enforces (pure; no I/O).

A step s is trained by the trainer at version s - 1 ("current"). With async.max_staleness K every
response token must have been sampled by a version in [max(0, s - 1 - K), s - 1]: a hard bound on each
token, not on a queue. In fixed_lag every token of the step comes from exactly one version, the header's;
in streaming a sequence paused at a weight update continues under the newer weights, so its versions
may rise along it but never fall (a replica does not go back to older weights mid-sequence).

Malformed versions (wrong count, falling, a trajectory version that is not its first token's) are
`InvalidRequest`; well-formed versions the step's bound does not admit are `FailedPrecondition`. Both
name the step and are raised while the stream is decoded, before anything is trained.
"""
from __future__ import annotations

from collections.abc import Sequence

from services.trainer.data.wire_errors import FailedPrecondition, InvalidRequest

# The run spec's bound on async.max_staleness; a header claiming more is malformed.
MAX_STALENESS_LIMIT = 64


def lowest_version(step: int, max_staleness: int) -> int:
    """The oldest policy version whose tokens step `step` may train on."""
    return max(0, step - 1 - max_staleness)


def check_header_bound(step: int, policy_version: int, max_staleness: int) -> None:
    """The header's policy_version must be the step's lowest admitted version."""
    if not 0 <= max_staleness <= MAX_STALENESS_LIMIT:
        raise InvalidRequest(f"header.max_staleness: {max_staleness} outside [0, {MAX_STALENESS_LIMIT}] (step {step})")
    lowest = lowest_version(step, max_staleness)
    if policy_version != lowest:
        raise InvalidRequest(
            f"header.policy_version: {policy_version}, but step {step} with max_staleness {max_staleness} "
            f"trains on versions from {lowest} (want policy_version = max(0, step - 1 - max_staleness))")


def token_versions(versions: Sequence[int], trajectory_version: int, num_tokens: int) -> list[int]:
    """The versions of a trajectory's tokens: as sent, or every token at the trajectory's version when
    none are sent (a synchronous sender's trajectories)."""
    return list(versions) if versions else [trajectory_version] * num_tokens


def check_token_versions(versions: Sequence[int], *, where: str, step: int, trajectory_version: int,
                         num_tokens: int, header_version: int, max_staleness: int, streaming: bool) -> list[int]:
    """Refuse a trajectory of step `step` whose token versions break the bound (see the module doc); the
    versions of its tokens otherwise (`token_versions`)."""
    field = f"{where}.token_policy_versions"
    if versions and len(versions) != num_tokens:
        raise InvalidRequest(f"{field}: {len(versions)} versions for {num_tokens} model tokens (step {step})")
    vs = token_versions(versions, trajectory_version, num_tokens)
    if vs[0] != trajectory_version:
        raise InvalidRequest(f"{where}.policy_version: {trajectory_version}, but its first token's version is "
                             f"{vs[0]} (step {step})")
    for j in range(1, len(vs)):
        if vs[j] < vs[j - 1]:
            raise InvalidRequest(f"{field}[{j}]: {vs[j]} after {vs[j - 1]}: versions decrease along the "
                                 f"trajectory (step {step})")
    lowest, current = lowest_version(step, max_staleness), step - 1
    for j, v in enumerate(vs):
        if not lowest <= v <= current:
            raise FailedPrecondition(
                f"step {step}: {field}[{j}]: version {v} outside [{lowest}, {current}] (max_staleness "
                f"{max_staleness}, trainer at {current}); nothing of the step is trained")
        if not streaming and v != header_version:
            raise FailedPrecondition(
                f"step {step}: {field}[{j}]: version {v}, but fixed_lag trains step {step} on version "
                f"{header_version} alone; nothing of the step is trained")
    return vs
