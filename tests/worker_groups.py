"""Which tests run together in one pytest-xdist worker, and in what order the groups are handed out.

`make test` runs the suite in two xdist workers: the serial suite keeps only about 1.3 of a 2-core host's
cores busy, since most of a stack test is one process at a time importing torch or waiting on another. A
worker is a pytest session of its own, so what a session or a module sets up once would be set up in
each worker that runs one of its tests:

- every test of a file goes to one worker (module fixtures: a file's stack or model is built once);
- files that use one of the costly session fixtures (SHARED_SESSION_FIXTURES: the warm-started model, the
  shared stacks, the SGLang server, the lone coordinator) go to one worker together, joined transitively,
  so each is started once per suite as in a serial run.

xdist's scheduler runs in a controller process that collects no tests, so the groups come from the test
files' text (`source_groups`: a file that names a shared fixture uses it); each worker checks them against
the fixtures its tests really use and stops the suite if a file uses one it does not name. `WorkerGroups`
is the scheduler (tests/conftest.py installs it): xdist's own `loadgroup` cannot be used, since pytest 9
ignores the node-id suffix it groups by.

The groups of the costliest files (COSTLIEST_FIRST, measured) are handed out first, in that order, then
the other groups holding a `stack` test, then the rest as collected: a long group handed out last would
leave the other worker idle at the end. The order only balances the workers.
"""
from __future__ import annotations

import re
from pathlib import Path

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


def test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def file_groups(uses: dict[str, set[str]]) -> dict[str, str]:
    """file -> group name, from file -> the shared session fixtures it uses: files sharing a fixture are one
    group (transitively), named after the first of them in `uses`' order; others are their own."""
    order = {f: i for i, f in enumerate(uses)}
    parent = {f: f for f in uses}

    def root(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    first_user: dict[str, str] = {}
    for f, fixtures in uses.items():
        for name in sorted(fixtures):
            if name not in first_user:
                first_user[name] = f
                continue
            a, b = root(first_user[name]), root(f)
            if a != b:
                parent[max(a, b, key=order.get)] = min(a, b, key=order.get)
    return {f: root(f) for f in uses}


def named_fixtures(text: str) -> set[str]:
    return {name for name in SHARED_SESSION_FIXTURES if re.search(rf"\b{name}\b", text)}


def source_groups(repo_root: Path) -> dict[str, str]:
    """file -> group for every test file under tests/, from the shared fixtures each file's text names."""
    files = sorted(p.relative_to(repo_root).as_posix() for p in (repo_root / "tests").rglob("test_*.py"))
    return file_groups({f: named_fixtures((repo_root / f).read_text()) for f in files})


def unnamed_uses(items: list[pytest.Item], repo_root: Path, shared_fixtures_of) -> list[str]:
    """'file: fixture' for each shared fixture a file's tests use (`shared_fixtures_of(item)`) that the
    file's text does not name: source_groups would put that file in the wrong worker."""
    named: dict[str, set[str]] = {}
    missing = set()
    for item in items:
        f = test_file(item.nodeid)
        if f not in named:
            named[f] = named_fixtures((repo_root / f).read_text()) if (repo_root / f).is_file() else set()
        missing |= {f"{f}: {name}" for name in set(shared_fixtures_of(item)) - named[f]}
    return sorted(missing)


def hand_out_order(groups: list[str], has_stack: set[str], costliest: list[str]) -> list[str]:
    """`costliest` (group names, in order) first, then the other groups with a stack test, then the rest; in
    collection order within each."""
    first = [g for g in dict.fromkeys(costliest) if g in groups]
    stacked = [g for g in groups if g in has_stack and g not in first]
    return first + stacked + [g for g in groups if g not in has_stack and g not in first]


def ordered(items: list[pytest.Item], group_of: dict[str, str]) -> list[pytest.Item]:
    """The items in hand-out order, each group's items together (stable within a group)."""
    members: dict[str, list[pytest.Item]] = {}
    has_stack: set[str] = set()
    for item in items:
        group = scope_of(item.nodeid, group_of)
        members.setdefault(group, []).append(item)
        if item.get_closest_marker("stack"):
            has_stack.add(group)
    order = hand_out_order(list(members), has_stack, [scope_of(f, group_of) for f in COSTLIEST_FIRST])
    return [item for group in order for item in members[group]]


def shared_fixtures(fixturenames) -> set[str]:
    return set(fixturenames) & set(SHARED_SESSION_FIXTURES)


def scope_of(nodeid: str, group_of: dict[str, str]) -> str:
    return group_of.get(test_file(nodeid), test_file(nodeid))


def scheduler(config: pytest.Config, log, group_of: dict[str, str]):
    """xdist's scope scheduling with a group of files (group_of) as the scope: each group goes whole to
    one worker, groups in the order they first appear in the collection (`ordered` sets it)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkerGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, group_of)

    return WorkerGroups(config, log)
