"""Dynamic sampling through the real stack, on the demo's warm-started policy (about a quarter of its
answers right, so some groups are informative and some are not): every trained group has differing
rewards, and every sampled trajectory is accounted for."""
from __future__ import annotations

import pytest

from services.common.records.step_record import read_step_record

pytestmark = pytest.mark.slow
PROMPTS, SAMPLES, STEPS = 8, 4, 2


def test_only_informative_groups_are_trained_and_every_trajectory_is_counted(warm_model, one_replica_stack):
    model = warm_model.path  # built once per session (tests/integration/conftest.py)
    assert 0.05 < warm_model.report["heldout_accuracy"] < 0.95
    stack = one_replica_stack
    client = stack.client()
    try:
        run = client.submit({
            "name": "dapo", "model_path": str(model), "seed": 1, "steps": STEPS,
            "task": {"name": "arithmetic", "options": {"seed": 0, "digits": 2, "heldout_size": 200}},
            "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                        "sampling": {"max_new_tokens": 5},
                        "dynamic_sampling": {"enabled": True, "max_rounds": 6}},
            "trainer": {"lr": 3e-4}, "eval": {"every": 0, "heldout_size": 8},
            "debug": {"record_trajectories": True},
        })
        assert client.wait(run["id"], timeout_s=300)["status"] == "completed"
        run_dir = stack.run_dir / "coordinator" / run["id"]
        rounds_seen = []
        for s in client.metrics(run["id"])["steps"]:
            m = s["metrics"]
            _, chunks = read_step_record(run_dir / "trajectories" / f"step_{s['step']:06d}.pb")
            trained = [c.trajectory for c in chunks[1:]]
            groups: dict[str, list[float]] = {}
            for t in trained:
                groups.setdefault(t.group_id, []).append(t.reward)
            assert len(trained) == m["trajectories_trained"]
            assert all(len(set(r)) > 1 for r in groups.values()), groups  # no zero-variance group
            assert all(len(r) == SAMPLES for r in groups.values())
            if len(groups) == PROMPTS:
                # Every sampled trajectory is trained, filtered (zero variance) or surplus.
                assert (m["trajectories_trained"] + m["trajectories_filtered"] + m["trajectories_surplus"]
                        + m["trajectories_dropped"]) == m["rollout_rounds"] * PROMPTS * SAMPLES, m
            rounds_seen.append(m["rollout_rounds"])
            # Group ids number prompts across rounds: those of later rounds are past the first round's.
            assert all(int(g.split("-g")[1]) < m["rollout_rounds"] * PROMPTS for g in groups)
        assert max(rounds_seen) > 1, "no step needed an extra round; the test shows nothing"
    finally:
        client.close()
