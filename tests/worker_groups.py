"""Which tests run together in one pytest-xdist worker, and in what order the groups are handed out.

`make test` runs the suite in two xdist workers (`--dist loadgroup`): the serial suite keeps only about
1.3 of a 2-core host's cores busy, since most of a stack test is one process at a time importing torch or
waiting on another. A worker is a pytest session of its own, so what a session or a module sets up once
would be set up in each worker that runs one of its tests:

- every test of a file goes to one worker (module fixtures: a file's stack or model is built once);
- files that use one of the costly session fixtures (SHARED_SESSION_FIXTURES: the warm-started model, the
  shared stacks, the SGLang server, the lone coordinator) go to one worker together, joined transitively,
  so each is started once per suite as in a serial run.

A group is named after its first file. The groups of the costliest files (COSTLIEST_FIRST, measured) are
handed out first, in that order, then the other groups holding a `stack` test, then the rest as collected:
a long group handed out last would leave the other worker idle at the end. The order only balances the
workers; a file missing from the list runs all the same.
"""
from __future__ import annotations

from collections.abc import Iterable

import pytest

# Session fixtures that start something costly (fixture name -> what), defined in tests/*/conftest.py.
SHARED_SESSION_FIXTURES = {
    "warm_model": "the demo's warm-started model (a minute of training)",
    "one_replica_stack": "a stack of four processes",
    "two_replica_stack": "a stack of five processes",
    "sglang_engine": "an SGLang server",
    "sglang_model_dir": "the SGLang server's model (its fixture starts the server)",
    "lone_coordinator": "a coordinator process and its redis-server",
}


# The files whose groups took longest in a clean-clone run on the 2-core host (their group's seconds, from
# `pytest --durations=0` summed by bench/suite_durations.py), costliest first.
COSTLIEST_FIRST = (
    "tests/integration/test_lora_run.py",  # the shared-stack group: about 300 s
    "tests/rollout/test_sglang_run.py",  # 130 s
    "tests/integration/test_broadcast_weights.py",  # 120 s
    "tests/rollout/test_sglang_engine.py",  # the session SGLang server's group: 120 s
    "tests/kernels/test_logprob_check_targets.py",  # 100 s
    "tests/integration/test_ray_stack.py",  # 85 s
    "tests/trainer/test_data_parallel.py",  # 55 s
    "tests/trainer/test_mixed_precision.py",  # 40 s
)


def test_file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def file_groups(uses: dict[str, set[str]]) -> dict[str, str]:
    """file -> group name, from file -> the shared session fixtures its tests use: files sharing a fixture
    are one group (transitively), named after the first of them in `uses`' order; others are their own."""
    parent = {f: f for f in uses}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    first_user: dict[str, str] = {}
    for f, fixtures in uses.items():
        for name in sorted(fixtures):
            if name in first_user:
                a, b = root(first_user[name]), root(f)
                if a != b:
                    # the earlier file names the group
                    order = list(uses)
                    parent[max(a, b, key=order.index)] = min(a, b, key=order.index)
            else:
                first_user[name] = f
    return {f: root(f) for f in uses}


def hand_out_order(groups: list[str], has_stack: set[str], costliest: list[str]) -> list[str]:
    """`costliest` (group names, in order) first, then the other groups with a stack test, then the rest; in
    collection order within each."""
    first = [g for g in dict.fromkeys(costliest) if g in groups]
    stacked = [g for g in groups if g in has_stack and g not in first]
    return first + stacked + [g for g in groups if g not in has_stack and g not in first]


def assign(items: list[pytest.Item], shared_fixtures_of) -> list[pytest.Item]:
    """Mark each item `xdist_group(<group>)` and return the items in hand-out order (stable within a group).
    `shared_fixtures_of(item)` names the SHARED_SESSION_FIXTURES the item uses."""
    uses: dict[str, set[str]] = {}
    for item in items:
        uses.setdefault(test_file(item), set()).update(shared_fixtures_of(item))
    group_of = file_groups(uses)
    members: dict[str, list[pytest.Item]] = {}
    has_stack: set[str] = set()
    for item in items:
        group = group_of[test_file(item)]
        item.add_marker(pytest.mark.xdist_group(group))
        members.setdefault(group, []).append(item)
        if item.get_closest_marker("stack"):
            has_stack.add(group)
    order = hand_out_order(list(members), has_stack, [group_of[f] for f in COSTLIEST_FIRST if f in group_of])
    return [item for group in order for item in members[group]]


def shared_fixtures(fixturenames: Iterable[str]) -> set[str]:
    return set(fixturenames) & set(SHARED_SESSION_FIXTURES)
