"""True on-policy through the real stack: the rollout's log-probs equal the trainer's recompute bit for bit.

The torch engine decodes with its KV cache; the trainer scores the same tokens packed, several
sequences per microbatch. In `numerics: true_on_policy` every op on that path is batch-invariant, so
at every step (not only before the first update) each response token's log-prob from the trainer is
the rollout's, in float32 and in bfloat16, and every importance weight is exactly 1. In `fast` mode the
same bfloat16 run does not agree bitwise, which is what makes the mode necessary (the parity gate's
tolerance is the safety net there).

Fixed-lag asynchronous runs share the stack: with async.max_staleness K the rollout of step s comes
from policy version max(0, s-1-K) by arithmetic, so two runs of one spec are bitwise identical (step
metrics, every trajectory sent to the trainer, final weights), K = 0 is the synchronous loop bit for
bit, and a trajectory's log-probs are exactly its behaviour policy's: the trainer's recompute equals
them when it holds that version (staleness 0) and differs once it has moved on. A killed coordinator
resumes a fixed-lag run bitwise.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest

from proto import lockstep_pb2 as pb
from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.common.records.step_record import read_step_record
from tests.support.weight_sync_runs import run_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # A wider init than Qwen3's default, so every token's distribution depends on its context.
    return build_model_dir(tmp_path_factory.mktemp("model") / "tiny", TinyQwen3Config(initializer_range=0.2), seed=0)


@pytest.fixture(scope="module")
def stack(one_replica_stack):
    return one_replica_stack  # the shared stack (tests/integration/conftest.py)


@pytest.fixture(scope="module")
def client(stack):
    c = stack.client()
    yield c
    c.close()


def spec(model_dir: Path, numerics: str, dtype: str) -> dict:
    return {
        "name": f"{numerics}-{dtype}",
        "model_path": str(model_dir),
        "seed": 5,
        "steps": 2,
        "numerics": numerics,
        "task": {"name": "arithmetic", "options": {"digits": 3, "heldout_size": 8}},
        "rollout": {"prompts_per_step": 6, "samples_per_prompt": 4, "engine_options": {"dtype": dtype},
                    "sampling": {"temperature": 1.0, "max_new_tokens": 10}},
        # Small microbatches: the 24 sequences are packed several to a buffer, in several buffers.
        "trainer": {"lr": 1e-3, "temperature": 1.0, "dtype": dtype, "batching": "packed",
                    "microbatch_tokens": 96,
                    "parity_gate": {"iw_mean_tolerance": 1.0, "iw_max": 1e6, "logprob_abs_diff_mean": 1.0}},
        "eval": {"every": 0, "heldout_size": 8},
    }


def step_metrics(client, run_spec: dict) -> list[dict]:
    return run_to_end(client, run_spec)[1]


def run_to_end(client, run_spec: dict) -> tuple[str, list[dict]]:
    """The completed run's id and its step metrics."""
    run = client.submit(run_spec)
    done = client.wait(run["id"], timeout_s=600)
    assert done["status"] == "completed", done
    steps = client.metrics(run["id"])["steps"]
    assert [s["step"] for s in steps] == list(range(1, run_spec["steps"] + 1))
    return run["id"], [s["metrics"] for s in steps]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_true_on_policy_log_probs_are_bitwise_the_rollouts_at_every_step(client, model_dir, dtype):
    for m in step_metrics(client, spec(model_dir, "true_on_policy", dtype)):
        assert m["tokens_response"] > 0
        assert m["logprob_abs_diff_max"] == 0.0, m
        assert m["iw_min"] == 1.0 and m["iw_max"] == 1.0 and m["iw_mean"] == 1.0, m


def test_fast_mode_in_bfloat16_does_not_agree_bitwise(client, model_dir):
    first = step_metrics(client, spec(model_dir, "fast", "bfloat16"))[0]
    assert first["logprob_abs_diff_max"] > 0.0, first


# ------------------------------------------------------------------ fixed lag --
LAG_STEPS = 3


def lagged(model_dir: Path, k: int | None, name: str) -> dict:
    s = copy.deepcopy(spec(model_dir, "true_on_policy", "float32"))
    s.update(name=name, steps=LAG_STEPS, debug={"record_trajectories": True})
    # This random tiny policy earns no reward, so its gradients are zero: AdamW's decoupled weight decay is
    # what moves the weights from version to version, so a stale version's log-probs differ from the trainer's.
    s["trainer"]["weight_decay"] = 0.1
    if k is not None:
        s["async"] = {"max_staleness": k, "mode": "fixed_lag"}
        if k > 0:  # decoupled PPO: the ratio against the trainer's own pre-update policy, TIS on the behaviour one
            s["trainer"]["mismatch_correction"] = {"mode": "truncate", "upper": 2.0}
    return s


def final_weights_sha256(stack, run_id: str) -> str:
    path = stack.run_dir / "coordinator" / run_id / "checkpoints" / f"step_{LAG_STEPS:06d}" / "model.safetensors"
    from safetensors.numpy import load_file

    digest = hashlib.sha256()
    for name, array in sorted(load_file(path).items()):
        digest.update(name.encode() + str(array.dtype).encode() + str(array.shape).encode() + array.tobytes())
    return digest.hexdigest()


def sent_trajectories(stack, run_id: str) -> dict[int, list[pb.Trajectory]]:
    """What the trainer was sent at each step (debug.record_trajectories), as recorded."""
    out = {}
    for step in range(1, LAG_STEPS + 1):
        meta, chunks = read_step_record(stack.run_dir / "coordinator" / run_id / "trajectories" / f"step_{step:06d}.pb")
        assert meta.step == step
        out[step] = [c.trajectory for c in chunks if c.WhichOneof("item") == "trajectory"]
        assert out[step]
    return out


def without_run_id(trajectories: list[pb.Trajectory]) -> list[bytes]:
    out = []
    for t in trajectories:
        t = pb.Trajectory.FromString(t.SerializeToString())
        t.run_id = ""
        out.append(t.SerializeToString(deterministic=True))
    return out


def test_staleness_zero_is_the_synchronous_loop_bitwise(stack, client, model_dir):
    sync_id, sync = run_to_end(client, lagged(model_dir, None, "sync"))
    k0_id, k0 = run_to_end(client, lagged(model_dir, 0, "k0"))
    assert k0 == sync
    assert final_weights_sha256(stack, k0_id) == final_weights_sha256(stack, sync_id)
    for step, trajectories in sent_trajectories(stack, k0_id).items():
        assert {t.policy_version for t in trajectories} == {step - 1}


@pytest.mark.parametrize("k", [1, 2])
def test_fixed_lag_runs_are_bitwise_reproducible_and_use_exactly_the_lagged_version(stack, client, model_dir, k):
    a_spec, b_spec = lagged(model_dir, k, f"lag{k}-a"), lagged(model_dir, k, f"lag{k}-b")
    if k == 2:  # the trainer divides the rate by the step's mean token staleness (checked below)
        for s in (a_spec, b_spec):
            s["trainer"]["lr_schedule"] = {"staleness_scaling": "inverse"}
    a_id, a = run_to_end(client, a_spec)
    # The second run syncs through the shared path, where replicas load each version while a step trains:
    # the overlapped sync must not change a bit.
    b_spec["rollout"]["weight_sync"] = "shared_path"
    b_id, b = run_to_end(client, b_spec)
    assert a == b
    assert final_weights_sha256(stack, a_id) == final_weights_sha256(stack, b_id)
    # Step 1 makes its own rollout after the sync; every later step's was made earlier, so its sync runs
    # while it trains.
    assert [m["weight_sync_beside_training"] for m in a] == [0] + [1] * (LAG_STEPS - 1)
    # Each version but the last was written right after its step trained and prefetched by every replica
    # while it generated; the sync that followed only applied it. The last one (synced as the run ends) was
    # written by its sync.
    synced_b = run_events(client, b_id, "weights_synced")
    assert [e["policy_version"] for e in synced_b] == list(range(1, LAG_STEPS + 1))
    assert [e["prefetched"] == e["replicas"] for e in synced_b] == [True] * (LAG_STEPS - 1) + [False], synced_b
    sent_a, sent_b = sent_trajectories(stack, a_id), sent_trajectories(stack, b_id)
    for step in range(1, LAG_STEPS + 1):
        version = max(0, step - 1 - k)
        assert {t.policy_version for t in sent_a[step]} == {version}, step
        assert without_run_id(sent_a[step]) == without_run_id(sent_b[step])
        m = a[step - 1]
        assert m["staleness_max"] == m["staleness_mean"] == step - 1 - version
        lr = a_spec["trainer"]["lr"]
        assert m["lr"] == (lr / max(1, step - 1 - version) if k == 2 else lr), (step, m["lr"])
        # true_on_policy: the rollout's log-probs are the behaviour policy's bits, so the trainer's recompute
        # equals them exactly when it holds that version, and not once it has moved on.
        if version == step - 1:
            assert m["logprob_abs_diff_max"] == 0.0, (step, m)
        else:
            assert m["logprob_abs_diff_max"] > 0.0, (step, m)


def test_fixed_lag_coordinator_killed_after_a_train_step_resumes_bitwise(stack, client, model_dir):
    """The coordinator dies right after the trainer applied step 2 (K = 1), while the replicas, at version 1,
    were generating step 3's rollout: the restarted one replays step 2, generates whatever rollout was lost
    with the replicas still at version 1, and ends bitwise as a run that was never interrupted."""
    _, reference = run_to_end(client, lagged(model_dir, 1, "lag-resume-ref"))
    args = list(stack.coordinator.args)
    stack.coordinator.stop()
    assert args[1:3] == ["-m", "services.coordinator"], args
    stack.coordinator.args = [args[0], "-m", "tests.support.crashing_coordinator", "--crash-after-train-step", "2",
                              *args[3:]]
    stack.restart_coordinator()
    c = stack.client()
    try:
        run = c.submit(lagged(model_dir, 1, "lag-resume"))
        stack.coordinator.proc.wait(timeout=300)
        assert stack.coordinator.proc.returncode == 137
    finally:
        c.close()
        stack.coordinator.args = args
        stack.restart_coordinator()
    fresh = stack.client()
    try:
        done = fresh.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        steps = fresh.metrics(run["id"])["steps"]
        assert [s["metrics"] for s in steps] == reference
        events = [e["event"] for e in fresh.run(run["id"])["events"]]
        assert events.count("step_replayed") == 1
    finally:
        fresh.close()
    for step, trajectories in sent_trajectories(stack, run["id"]).items():
        assert {t.policy_version for t in trajectories} == {max(0, step - 2)}


# ------------------------------------------------------------------ streaming --
def test_streaming_trains_only_tokens_within_the_bound_with_their_versions_exact_log_probs(stack, client, model_dir,
                                                                                          tmp_path):
    """async.mode streaming, K = 1: the replicas generate ahead continuously and a weight sync pauses what is
    in flight, so a trajectory's tokens may come from several versions. Every token the trainer was sent is
    of a version in [s-2, s-1], never falling along its trajectory, and (true_on_policy) its rollout
    log-prob is bitwise what a trainer holding that very version computes: checked by loading each
    version's checkpoint into a trainer of this process and scoring the trajectories with it. (Whether a
    sync finds a rollout in flight here depends on timing: on this tiny model generation usually outpaces a
    train step. tests/coordinator/run/test_streaming.py pauses one deterministically and checks the same.)"""
    import json

    from services.trainer.trainer import Trainer
    from services.trainer.data.wire import StepRequest, decode_trajectory

    s = lagged(model_dir, 1, "streaming")
    s["async"]["mode"] = "streaming"
    s["checkpoint"] = {"every": 1}  # each version's weights, to score its tokens with
    s["trainer"]["parity_gate"]["worst_tokens"] = 1000  # the check below reads every token's score from it
    run_id, metrics = run_to_end(client, s)
    sent = sent_trajectories(stack, run_id)
    by_version: dict[int, list[tuple[pb.Trajectory, int]]] = {}
    # Step 1's rollout is made after its sync; a later step whose rollout was complete as it began synced
    # while it trained (how many did depends on timing, as above).
    assert metrics[0]["weight_sync_beside_training"] == 0
    assert all(m["weight_sync_beside_training"] in (0, 1) for m in metrics)
    for step, trajectories in sent.items():
        m = metrics[step - 1]
        assert m["trajectories_dropped_stale"] == 0 and m["trajectories_trained"] == len(trajectories), m
        assert m["token_staleness_max"] <= 1 and m["staleness_max"] <= 1, m
        for t in trajectories:
            versions = list(t.token_policy_versions)
            assert versions and versions == sorted(versions) and t.policy_version == versions[0], versions
            assert all(max(0, step - 2) <= v <= step - 1 for v in versions), (step, versions)
            for v in set(versions):
                by_version.setdefault(v, []).append((t, step))
    assert set(by_version) <= {0, 1, 2}
    checkpoints = stack.run_dir / "coordinator" / run_id / "checkpoints"
    checked = 0
    for version, items in sorted(by_version.items()):
        trainer = Trainer(device="cpu", num_threads=1)
        trainer.configure(run_id=run_id, model_path=str(model_dir), seed=s["seed"],
                          config_json=json.dumps(s["trainer"] | {"numerics": "true_on_policy"}),
                          resume_checkpoint=str(checkpoints / f"step_{version:06d}") if version else "")
        header = pb.TrainStepHeader(run_id=run_id, step=version + 1, policy_version=version, max_staleness=64,
                                    streaming=True)
        samples, wanted = [], set()
        for i, (t, step) in enumerate(items):
            t = pb.Trajectory.FromString(t.SerializeToString())
            t.step, t.sample_id = version + 1, f"{t.sample_id}@{step}"
            del t.token_policy_versions[:]
            t.policy_version = version
            samples.append(decode_trajectory(t, i, header))
            prompt_len = samples[-1].prompt_ids.numel()
            wanted |= {(t.sample_id, prompt_len + j) for j, v in enumerate(items[i][0].token_policy_versions)
                       if v == version}
        verdict = trainer.check_parity(StepRequest(run_id, version + 1, version, samples))
        scored = {(w.sample_id, w.position): (w.logp, w.rollout_logp) for w in verdict.worst}
        assert wanted <= set(scored), "every token of this version scored"
        for key in wanted:
            logp, rollout_logp = scored[key]
            assert logp == rollout_logp, (version, key, logp, rollout_logp)
        checked += len(wanted)
    assert checked == sum(m["tokens_response"] for m in metrics)


def test_streaming_coordinator_killed_after_a_train_step_trains_every_step_exactly_once(stack, model_dir):
    """The coordinator dies right after the trainer applied step 2 of a streaming run (K = 1), with the
    replicas generating ahead. The restarted one replays step 2 (its recorded metrics, no second update),
    generates again whatever rollout was in flight, and the run ends with every step recorded once, every
    trajectory of every step accounted for, and every trained token within the bound."""
    s = lagged(model_dir, 1, "streaming-resume")
    s["async"]["mode"] = "streaming"
    per_step = s["rollout"]["prompts_per_step"] * s["rollout"]["samples_per_prompt"]
    args = list(stack.coordinator.args)
    stack.coordinator.stop()
    stack.coordinator.args = [args[0], "-m", "tests.support.crashing_coordinator", "--crash-after-train-step", "2",
                              *args[3:]]
    stack.restart_coordinator()
    c = stack.client()
    try:
        run = c.submit(s)
        stack.coordinator.proc.wait(timeout=300)
        assert stack.coordinator.proc.returncode == 137
    finally:
        c.close()
        stack.coordinator.args = args
        stack.restart_coordinator()
    fresh = stack.client()
    try:
        done = fresh.wait(run["id"], timeout_s=600)
        assert done["status"] == "completed", done
        steps = fresh.metrics(run["id"])["steps"]
        events = [e["event"] for e in fresh.run(run["id"])["events"]]
    finally:
        fresh.close()
    assert [x["step"] for x in steps] == [1, 2, 3] and events.count("step_replayed") == 1
    for x in steps:
        m = x["metrics"]
        accounted = m["trajectories_trained"] + m["trajectories_dropped"] + m.get("trajectories_dropped_stale", 0)
        assert accounted == per_step and m["token_staleness_max"] <= 1, m
    for step, trajectories in sent_trajectories(stack, run["id"]).items():
        assert all(max(0, step - 2) <= v <= step - 1 for t in trajectories for v in t.token_policy_versions), step
