"""How the suite's tests are grouped for its xdist workers (tests/worker_groups.py)."""
from __future__ import annotations

import pytest

from tests.worker_groups import COSTLIEST_FIRST, assign, file_groups, hand_out_order


def test_files_sharing_a_session_fixture_are_one_group_transitively_named_by_the_first():
    uses = {"a.py": {"warm_model"}, "b.py": set(), "c.py": {"one_replica_stack"},
            "d.py": {"one_replica_stack", "warm_model"}, "e.py": {"sglang_engine"}, "f.py": {"sglang_engine"}}
    assert file_groups(uses) == {"a.py": "a.py", "b.py": "b.py", "c.py": "a.py", "d.py": "a.py",
                                 "e.py": "e.py", "f.py": "e.py"}


def test_the_costliest_groups_go_first_then_other_stacks_then_the_rest_as_collected():
    groups = ["unit1", "stack1", "unit2", "costly_stack", "stack2", "costly_unit"]
    assert hand_out_order(groups, {"stack1", "costly_stack", "stack2"}, ["costly_stack", "gone", "costly_unit",
                                                                        "costly_stack"]) == \
        ["costly_stack", "costly_unit", "stack1", "stack2", "unit1", "unit2"]


class Item:
    """What assign reads of a pytest item: its node id and marks."""

    def __init__(self, nodeid: str, fixtures: set[str], stack: bool = False) -> None:
        self.nodeid, self.fixtures = nodeid, fixtures
        self.marks = [pytest.mark.stack.mark] if stack else []

    def add_marker(self, marker) -> None:
        self.marks.append(marker.mark)

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)

    def group(self) -> str:
        (mark,) = [m for m in self.marks if m.name == "xdist_group"]
        return mark.args[0]


def test_assign_keeps_a_file_together_and_orders_items_by_group():
    items = [Item("u.py::t1", set()), Item("s.py::t1", {"warm_model"}, stack=True), Item("u.py::t2", set()),
             Item("s.py::t2", set(), stack=True), Item("r.py::t1", {"warm_model"})]
    ordered = assign(items, lambda item: item.fixtures)
    # s.py's second test uses no shared fixture but stays with its file, and r.py joins s.py's group.
    assert [(i.nodeid, i.group()) for i in ordered] == [
        ("s.py::t1", "s.py"), ("s.py::t2", "s.py"), ("r.py::t1", "s.py"), ("u.py::t1", "u.py"), ("u.py::t2", "u.py")]


def test_every_costliest_file_exists(repo_root):
    assert [f for f in COSTLIEST_FIRST if not (repo_root / f).is_file()] == []
