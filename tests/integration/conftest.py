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
from tests.conftest import BACKGROUND_BUILD_FIXTURE
from tests.support.background_build import BackgroundBuild

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
def reward_model_build(warm_model, tmp_path_factory) -> BackgroundBuild:
    """The tiny_judge recipe's reward model on the demo's warm start, built by the recipe's own
    `python -m recipes.tiny_judge.reward_model` with its default training, seed 0, one thread, in the background
    (minutes of one core; `tiny_reward_model` waits for it). One thread: the same bits as the recipe's two, in
    about 0.8 of the CPU time (on two shared cores a second thread mostly waits for the first)."""
    root = tmp_path_factory.mktemp("rm")
    build = BackgroundBuild.start([sys.executable, "-m", "recipes.tiny_judge.reward_model", "--policy",
                                   str(warm_model.path), "--out", str(root / "model"), "--seed", "0", "--threads", "1"],
                                  cwd=REPO, logs=root)
    yield build
    build.cancel()


@pytest.fixture(scope="session", autouse=True)
def _start_background_builds(request):
    """Starts the reward model's build with the session's first integration test when a later test will need
    it: tests/conftest.py orders those tests last, so the build overlaps with the learning runs before them."""
    if any(BACKGROUND_BUILD_FIXTURE in item.fixturenames for item in request.session.items):
        request.getfixturevalue(BACKGROUND_BUILD_FIXTURE)


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
