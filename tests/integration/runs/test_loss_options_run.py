"""M2PO with Dr. GRPO's options through the real stack, on the demo's warm-started policy (about a quarter
of its answers right, so groups have differing rewards): the coordinator computes advantages without the
std division, the trainer trains with the M2PO loss and the constant-normalised aggregation, and the new
step metrics reach the REST API and the coordinator's Prometheus exporter."""
from __future__ import annotations

import httpx
import pytest

from services.common.records.step_record import read_step_record

pytestmark = pytest.mark.slow
PROMPTS, SAMPLES, STEPS = 8, 4, 2
NEW_METRICS = ("m2po_masked_fraction", "seq_clip_fraction", "m2po_m2", "log_ratio_clamped_tokens")


def test_m2po_dr_grpo_run_trains_and_reports(warm_model, one_replica_stack):
    model = warm_model.path  # built once per session (tests/integration/conftest.py)
    stack = one_replica_stack
    client = stack.client()
    try:
        run = client.submit({
            "name": "m2po-dr-grpo", "model_path": str(model), "seed": 1, "steps": STEPS,
            "task": {"name": "arithmetic", "options": {"seed": 0, "digits": 2, "heldout_size": 200}},
            "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": SAMPLES,
                        "sampling": {"max_new_tokens": 5}},
            "trainer": {"lr": 3e-4, "policy_loss": {"kind": "m2po"}, "advantage_std_normalization": False,
                        "loss_agg": "seq_mean_token_sum_norm", "loss_agg_tokens": 5},
            "eval": {"every": 0, "heldout_size": 8},
            "debug": {"record_trajectories": True},
        })
        assert client.wait(run["id"], timeout_s=300)["status"] == "completed"
        run_dir = stack.run_dir / "coordinator" / run["id"]
        informative = 0
        steps = client.metrics(run["id"])["steps"]
        assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
        for s in steps:
            _, chunks = read_step_record(run_dir / "trajectories" / f"step_{s['step']:06d}.pb")
            groups: dict[str, list] = {}
            for t in (c.trajectory for c in chunks[1:]):
                groups.setdefault(t.group_id, []).append(t)
            for trajectories in groups.values():
                rewards = [t.reward for t in trajectories]
                mean = sum(rewards) / len(rewards)
                # Dr. GRPO: reward - group mean, not divided by the group's std.
                assert [t.advantage for t in trajectories] == pytest.approx([r - mean for r in rewards], abs=1e-6)
                informative += len(set(rewards)) > 1
            m = s["metrics"]
            assert all(k in m for k in NEW_METRICS), sorted(m)
            assert 0.0 <= m["m2po_masked_fraction"] < 1.0 and m["seq_clip_fraction"] == 0.0
        # Binary rewards with a spread: std != 1, so the check above tells the two advantages apart.
        assert informative > 0, "no group had differing rewards; the test shows nothing"
        exported = httpx.get(f"{stack.api_url}/metrics", timeout=10).text
        for key in NEW_METRICS:
            assert f'lockstep_step_{key}{{run_id="{run["id"]}"}}' in exported, key
    finally:
        client.close()
