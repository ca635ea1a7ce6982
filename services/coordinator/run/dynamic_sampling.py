"""Dynamic sampling (DAPO): train only on groups whose rewards differ.

A GRPO group whose samples all got the same reward has advantage 0 on every
token: it costs a forward and backward and moves nothing, and it dilutes the
token-mean loss of the groups that do carry signal. With dynamic sampling the
coordinator drops such groups and samples further prompts (a new, seeded draw
per round) until the step holds `prompts_per_step` informative groups or
`max_rounds` extra rounds are spent.

Pure selection logic here; the run loop does the sampling rounds.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proto import lockstep_pb2 as pb


def groups_in_order(trajectories: Sequence[pb.Trajectory]) -> list[list[pb.Trajectory]]:
    """Trajectories grouped by group_id, groups in order of first appearance, members in input order."""
    groups: dict[str, list[pb.Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    return list(groups.values())


def is_informative(group: Sequence[pb.Trajectory]) -> bool:
    """Rewards that differ within the group: its advantages are not all zero."""
    return len({t.reward for t in group}) > 1


@dataclass(frozen=True)
class Selection:
    kept: list[pb.Trajectory]  # the informative groups, at most `want` of them, in sampling order
    filtered: int              # trajectories of zero-variance groups dropped
    surplus: int               # trajectories of informative groups beyond `want` (sampled, not trained)

    @property
    def groups(self) -> int:
        return len({t.group_id for t in self.kept})


def select_informative(rounds: Sequence[Sequence[pb.Trajectory]], want: int) -> Selection:
    """The first `want` informative groups over the rounds, in order."""
    kept: list[pb.Trajectory] = []
    filtered = surplus = n_groups = 0
    for trajectories in rounds:
        for group in groups_in_order(trajectories):
            if not is_informative(group):
                filtered += len(group)
            elif n_groups < want:
                kept.extend(group)
                n_groups += 1
            else:
                surplus += len(group)
    return Selection(kept, filtered, surplus)
