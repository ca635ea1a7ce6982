"""What the integration tests share: the demo's warm-started policy, and stacks that tests leave as they found them.

Starting a stack is four Python processes importing torch, and the warm start trains for about a minute:
on the 2-core CI host these dominate the suite's time, so each is paid once per session by the tests that
only use it. Sharing is sound because a stack serves one run at a time and every run is configured afresh
on every service (ConfigureRun, LoadModel): a run's metrics depend on its spec, not on the runs before it
(the same-seed tests in test_stack.py check exactly that, on a stack that has already served other runs).
A test that kills a process, starts one with other options, or needs a service history of its own starts
its own stack instead.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.local_stack import LocalStack

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class WarmModel:
    path: Path
    report: dict
    """The JSON line `recipes.tiny_arith.prepare` printed (held-out accuracy, steps, ...)."""


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory) -> WarmModel:
    """The demo's warm-started tiny policy (about a quarter of its greedy answers right), built once by the
    demo's own `python -m recipes.tiny_arith.prepare`. Tests read it and never write it."""
    path = tmp_path_factory.mktemp("warm") / "model"
    prep = subprocess.run([sys.executable, "-m", "recipes.tiny_arith.prepare", "--out", str(path), "--seed", "0",
                           "--threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert prep.returncode == 0, prep.stderr[-3000:]
    return WarmModel(path, json.loads(prep.stdout.strip().splitlines()[-1]))


@pytest.fixture(scope="session")
def one_replica_stack(tmp_path_factory):
    """Trainer, one torch rollout replica, coordinator and its embedded Redis, with default options. Models
    and datasets may come from any of the session's temporary directories."""
    with LocalStack(tmp_path_factory.mktemp("stack1"), path_roots=[tmp_path_factory.getbasetemp()]) as stack:
        yield stack


@pytest.fixture(scope="session")
def two_replica_stack(tmp_path_factory):
    """Trainer, two torch rollout replicas, coordinator and its embedded Redis, with default options."""
    with LocalStack(tmp_path_factory.mktemp("stack2"), rollout_replicas=2,
                    path_roots=[tmp_path_factory.getbasetemp()]) as stack:
        yield stack
