"""How the suite's tests are grouped for its xdist workers (tests/worker_groups.py)."""
from __future__ import annotations

import pytest

from tests.worker_groups import (COSTLIEST_FIRST, SHARED_SESSION_FIXTURES, file_groups, hand_out_order, ordered,
                                 scope_of, source_groups, unnamed_uses)


def test_files_sharing_a_session_fixture_are_one_group_transitively_named_by_the_first():
    uses = {"a.py": {"fx1"}, "b.py": set(), "c.py": {"fx2"}, "d.py": {"fx2", "fx1"}, "e.py": {"fx3"},
            "f.py": {"fx3"}}
    assert file_groups(uses) == {"a.py": "a.py", "b.py": "b.py", "c.py": "a.py", "d.py": "a.py",
                                 "e.py": "e.py", "f.py": "e.py"}


def test_the_costliest_groups_go_first_then_other_stacks_then_the_rest_as_collected():
    groups = ["unit1", "stack1", "unit2", "costly_stack", "stack2", "costly_unit"]
    assert hand_out_order(groups, {"stack1", "costly_stack", "stack2"}, ["costly_stack", "gone", "costly_unit",
                                                                        "costly_stack"]) == \
        ["costly_stack", "costly_unit", "stack1", "stack2", "unit1", "unit2"]


class Item:
    """What the grouping reads of a pytest item: its node id, marks and fixtures."""

    def __init__(self, nodeid: str, fixtures: set[str] = frozenset(), stack: bool = False) -> None:
        self.nodeid, self.fixtures = nodeid, set(fixtures)
        self.marks = [pytest.mark.stack.mark] if stack else []

    def get_closest_marker(self, name: str):
        return next((m for m in self.marks if m.name == name), None)


def test_items_are_handed_out_group_by_group():
    items = [Item("u.py::t1"), Item("s.py::t1", stack=True), Item("u.py::t2"), Item("s.py::t2", stack=True),
             Item("r.py::t1")]
    got = ordered(items, {"u.py": "u.py", "s.py": "s.py", "r.py": "s.py"})
    assert [i.nodeid for i in got] == ["s.py::t1", "s.py::t2", "r.py::t1", "u.py::t1", "u.py::t2"]


def test_the_suites_groups_keep_each_shared_fixtures_users_together(repo_root):
    groups = source_groups(repo_root)
    group = groups["tests/integration/test_lora_run.py"]
    assert groups["tests/integration/test_true_on_policy_stack.py"] == group  # the warm model, shared stacks
    assert groups["tests/rollout/test_sglang_streaming.py"] == groups["tests/rollout/test_sglang_engine.py"]
    assert groups["tests/coordinator/test_hostile_rest.py"] == groups["tests/coordinator/test_openapi_contract.py"]
    assert groups["tests/common/test_ports.py"] == "tests/common/test_ports.py"
    assert [f for f in COSTLIEST_FIRST if f not in groups] == []


def test_a_file_using_a_shared_fixture_it_does_not_name_is_reported(tmp_path):
    # The fixture names are not spelled out here: this file would name them (and join their group).
    first, second = sorted(SHARED_SESSION_FIXTURES)[:2]
    (tmp_path / "test_named.py").write_text(f"def test_a({first}): ...\n")
    (tmp_path / "test_hidden.py").write_text("def test_b(my_stack): ...  # my_stack is built on another\n")
    items = [Item("test_named.py::test_a", {first}), Item("test_hidden.py::test_b", {second})]
    assert unnamed_uses(items, tmp_path, lambda item: item.fixtures) == [f"test_hidden.py: {second}"]


def test_a_whole_group_is_one_scope_of_the_scheduler():
    group_of = {"tests/a.py": "tests/a.py", "tests/b.py": "tests/a.py"}
    assert scope_of("tests/b.py::test_x[1]", group_of) == scope_of("tests/a.py::test_y", group_of) == "tests/a.py"
    assert scope_of("tests/c.py::test_z", group_of) == "tests/c.py"
