"""Dynamic sampling's selection, by hand; and the extra-round prompt draws."""
from __future__ import annotations

from proto import lockstep_pb2 as pb
from services.coordinator.run.dynamic_sampling import groups_in_order, is_informative, select_informative
from services.coordinator.run.prompts import step_problems
from services.coordinator.tasks.base import Problem


def _round(spec: dict[str, list[float]]) -> list[pb.Trajectory]:
    """Interleaved members, as replicas return them: group order is first appearance."""
    out, longest = [], max(len(r) for r in spec.values())
    for i in range(longest):
        for gid, rewards in spec.items():
            if i < len(rewards):
                out.append(pb.Trajectory(group_id=gid, sample_id=f"{gid}/{i}", reward=rewards[i]))
    return out


def test_groups_keep_first_appearance_order_and_member_order():
    groups = groups_in_order(_round({"a": [1, 0], "b": [0, 0, 0]}))
    assert [[t.sample_id for t in g] for g in groups] == [["a/0", "a/1"], ["b/0", "b/1", "b/2"]]
    assert is_informative(groups[0]) and not is_informative(groups[1])


def test_selection_takes_the_first_informative_groups_over_rounds():
    r0 = _round({"g0": [0, 0], "g1": [1, 0], "g2": [1, 1], "g3": [0, 1]})
    r1 = _round({"g4": [0, 0], "g5": [0.5, 0], "g6": [1, 0]})
    sel = select_informative([r0, r1], want=3)
    assert sel.groups == 3 and [t.group_id for t in sel.kept] == ["g1", "g1", "g3", "g3", "g5", "g5"]
    assert sel.filtered == 6 and sel.surplus == 2  # g0, g2, g4 filtered; g6 informative but not needed
    assert select_informative([r0], want=3).groups == 2  # short: the run loop samples another round


def test_extra_rounds_draw_other_prompts_and_round_zero_is_unchanged():
    train = [Problem(str(i), f"{i}+0=", str(i)) for i in range(1000)]
    r0 = step_problems(train, seed=3, step=5, count=16)
    assert step_problems(train, seed=3, step=5, count=16, round=0) == r0
    r1 = step_problems(train, seed=3, step=5, count=16, round=1)
    assert r1 == step_problems(train, seed=3, step=5, count=16, round=1) and r1 != r0
    assert step_problems(train, seed=3, step=5, count=16, round=2) not in (r0, r1)
