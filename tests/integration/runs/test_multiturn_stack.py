"""Multi-turn episodes through the real stack: coordinator, a torch rollout replica and the trainer.

A tiny model plays `number_guess` (find a hidden number from higher/lower feedback) for 3 turns in
numerics true_on_policy: the rollout runs each episode turn by turn in its own environment process and
returns the trajectory with its response mask; the trainer scores the model's tokens only, each with the
rollout's bits, so the step-1 importance weights are exactly 1.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.cli.client import ApiError
from services.common.records.step_record import read_step_record


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="module")
def client(one_replica_stack):
    c = one_replica_stack.client()
    yield c
    c.close()


def _spec(model_dir: Path, **over) -> dict:
    return {
        "name": "guess", "model_path": str(model_dir), "seed": 3, "steps": 1, "numerics": "true_on_policy",
        "task": {"name": "number_guess", "options": {"heldout_size": 4, "episode": {
            "max_turns": 3, "max_episode_tokens": 96, "step_timeout_s": 10.0}}},
        "rollout": {"prompts_per_step": 3, "samples_per_prompt": 2, "engine_options": {"dtype": "float32"},
                    "sampling": {"temperature": 1.0, "max_new_tokens": 6}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, "dtype": "float32", "batching": "packed"},
        "eval": {"every": 0, "heldout_size": 4},
        "debug": {"record_trajectories": True},
        **over,
    }


def test_three_turn_episodes_train_with_importance_weights_exactly_one(client, model_dir, one_replica_stack):
    run = client.submit(_spec(model_dir))
    done = client.wait(run["id"], timeout_s=600)
    assert done["status"] == "completed", done
    (step,) = client.metrics(run["id"])["steps"]
    m = step["metrics"]
    # Over the model's tokens only, the trainer's recompute is the rollout's bits.
    assert m["iw_min"] == m["iw_max"] == 1.0 and m["logprob_abs_diff_max"] == 0.0
    assert m["episodes"] == 6 and m["trajectories_trained"] == 6
    # An untrained model rarely finds the number: most episodes run all 3 turns, with observations between.
    assert m["episode_turns_max"] == 3 and m["episodes_end_max_turns"] >= 1
    assert m["episodes_end_max_turns"] + m["episodes_end_done"] + m["episodes_end_max_episode_tokens"] == 6
    assert 0 < m["episode_model_token_fraction"] < 1
    # The held-out split is evaluated through episodes too, rewarded by the environment.
    assert 0.0 <= m["eval_accuracy"] <= 1.0 and m["episode_tool_calls_mean"] == 0.0
    # The step's record holds each episode: its mask, turns, per-turn rewards and end reason.
    _, chunks = read_step_record(one_replica_stack.run_dir / "coordinator" / run["id"] / "trajectories"
                                 / "step_000001.pb")
    trajectories = [c.trajectory for c in chunks if c.WhichOneof("item") == "trajectory"]
    assert len(trajectories) == 6
    for t in trajectories:
        mask = np.frombuffer(t.response_mask.data, dtype=bool)
        assert mask.size == t.response_token_ids.shape[0] and mask.sum() == t.rollout_logprobs.shape[0]
        assert len(t.episode.turn_rewards) == t.episode.turns and t.reward == pytest.approx(sum(t.episode.turn_rewards))
        assert t.episode.end_reason in ("done", "max_turns", "max_episode_tokens")
    # ... and the REST view reads them back (what `lockstep episodes RUN 1` prints).
    view = client.episodes(run["id"], 1)
    assert [e["sample_id"] for e in view["episodes"]] == [t.sample_id for t in trajectories]
    for e, t in zip(view["episodes"], trajectories):
        assert (e["turns"], e["turn_rewards"], e["end_reason"]) == (t.episode.turns, list(t.episode.turn_rewards),
                                                                    t.episode.end_reason)
        assert e["model_tokens"] == t.rollout_logprobs.shape[0]
        assert e["model_tokens"] + e["environment_tokens"] == t.response_token_ids.shape[0]
    with pytest.raises(ApiError) as missing:
        client.episodes(run["id"], 2)
    assert missing.value.status == 404 and "no trajectory record" in str(missing.value)

