"""A fixed-lag run's kept rollouts: written before use, read back by a fresh coordinator, forgotten once safe."""
from __future__ import annotations

from contract.wire_tensors import ids_to_proto
from proto import lockstep_pb2 as pb
from services.coordinator.state.kept_rollouts import KeptRollouts


def _trajectory(step: int, i: int) -> pb.Trajectory:
    return pb.Trajectory(run_id="r", step=step, policy_version=max(0, step - 2), group_id=f"s{step}-g0",
                         sample_id=f"s{step}-g0/{i}", prompt_token_ids=ids_to_proto([1, 2]),
                         response_token_ids=ids_to_proto([3 + i]), reward=float(i), advantage=0.5)


def test_kept_rollouts_survive_a_fresh_reader_and_are_dropped_through_a_step(tmp_path):
    kept = KeptRollouts("r", tmp_path / "rollouts", model_path="/m", seed=3)
    for step in (2, 3, 4):
        kept.put(step, max(0, step - 2), [_trajectory(step, 0), _trajectory(step, 1)],
                 {"trajectories_trained": 2, "staleness_max": 1.0})
    fresh = KeptRollouts("r", tmp_path / "rollouts", model_path="/m", seed=3)  # a restarted coordinator
    assert fresh.get(1) is None and not fresh.has(1)
    trajectories, counts = fresh.get(3)
    assert [t.SerializeToString(deterministic=True) for t in trajectories] == \
        [_trajectory(3, i).SerializeToString(deterministic=True) for i in range(2)]
    assert counts == {"trajectories_trained": 2, "staleness_max": 1.0}
    fresh.drop_through(3)
    assert not fresh.has(2) and not fresh.has(3) and fresh.has(4)
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_000004.counts.json", "step_000004.pb"]
