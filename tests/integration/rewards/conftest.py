"""One stack for every reward test: trainer, one policy replica, the coordinator, and three scorer replicas,
built once per session (each is a process importing torch):

- scorer 0, the real rollout service in role scorer (reward-model and judge runs load their model on it);
- scorer 1, tests.support.hostile_scorer: corrupts the answers its faults file names, and logs each injection;
- scorer 2, a hostile scorer the kill test makes exit mid-step (it stays dead: no other test names it).

Every test scores with one reward model, the tiny_judge recipe's own (`tiny_reward_model`), built once per session:
the learning test needs the recipe's, and the other tests only need a model whose scores differ by sample.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.local_stack import LocalStack


@dataclass(frozen=True)
class RewardStack:
    stack: LocalStack
    reward_model: Path
    hostile_faults: Path
    victim_faults: Path

    @property
    def scorers(self) -> list[str]:
        return self.stack.scorer_addresses


@dataclass(frozen=True)
class RewardModel:
    path: Path
    report: dict
    """The JSON line `recipes.tiny_judge.reward_model` printed (steps, probe agreement, ...), and its wall seconds."""


@pytest.fixture(scope="session")
def tiny_reward_model(reward_model_build) -> RewardModel:
    """The tiny_judge recipe's reward model on the demo's warm start (tests/integration/conftest.py builds it in
    the background from the session's first integration test on)."""
    report = reward_model_build.report(timeout_s=1800)
    return RewardModel(Path(report["model_dir"]), {**report, "wall_seconds": round(reward_model_build.wall_seconds, 1)})


@pytest.fixture(scope="session")
def reward_stack(tmp_path_factory, tiny_reward_model) -> RewardStack:
    root = tmp_path_factory.mktemp("reward_stack")
    hostile, victim = root / "hostile_faults.json", root / "victim_faults.json"
    scorers = [("services.rollout",), ("tests.support.hostile_scorer", "--faults", str(hostile)),
               ("tests.support.hostile_scorer", "--faults", str(victim))]
    with LocalStack(root, path_roots=[tmp_path_factory.getbasetemp()], scorers=scorers) as stack:
        yield RewardStack(stack, tiny_reward_model.path, hostile, victim)


def write_faults(path: Path, faults: dict[str, dict], hang_s: float = 30.0) -> None:
    path.write_text(json.dumps({"faults": faults, "hang_s": hang_s}))


def injected(path: Path, run_id: str) -> list[dict]:
    log = Path(str(path) + ".injected.jsonl")
    if not log.exists():
        return []
    return [r for r in map(json.loads, log.read_text().splitlines()) if r["run_id"] == run_id]
