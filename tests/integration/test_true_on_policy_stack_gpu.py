"""Fixed-lag async runs on a GPU through the real stack, in bfloat16: two runs of one spec are bitwise
identical, each step's rollout comes from exactly the lagged version, and the trainer's recompute equals
the rollout's log-probs whenever it holds the behaviour version (test_true_on_policy_stack.py checks the
same on CPU in float32; this is the GPU's batch-invariant kernels on the same path)."""
from __future__ import annotations

import pytest
import torch

from services.local_stack import LocalStack
from tests.integration.test_true_on_policy_stack import (  # noqa: F401 - client and model_dir are fixtures
    LAG_STEPS,
    client,
    final_weights_sha256,
    lagged,
    model_dir,
    run_to_end,
    sent_trajectories,
    without_run_id,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    with LocalStack(tmp_path_factory.mktemp("stack"), path_roots=[tmp_path_factory.getbasetemp()],
                    extra_env={"LOCKSTEP_TRAINER_DEVICE": "cuda"}) as s:
        yield s


def on_gpu(spec: dict) -> dict:
    spec["rollout"]["engine_options"].update(device="cuda", dtype="bfloat16")
    spec["trainer"]["dtype"] = "bfloat16"
    return spec


@pytest.mark.parametrize("k", [1, 2])
def test_fixed_lag_runs_on_a_gpu_are_bitwise_reproducible_with_exact_behaviour_log_probs(stack, client, model_dir, k):
    a_id, a = run_to_end(client, on_gpu(lagged(model_dir, k, f"gpu-lag{k}-a")))
    b_id, b = run_to_end(client, on_gpu(lagged(model_dir, k, f"gpu-lag{k}-b")))
    assert a == b
    f = client.run(a_id)["fingerprint"]  # trained and sampled on the GPU, not on a CPU fallback
    assert all(service["platform"]["device"] == "cuda" for service in (f["trainer"], *f["rollouts"])), f
    print("\n", f["trainer"]["platform"]["device_name"], f["trainer"]["logprob_backend"],
          f["trainer"]["attention_backend"], [m["logprob_abs_diff_max"] for m in a])
    assert final_weights_sha256(stack, a_id) == final_weights_sha256(stack, b_id)
    sent_a, sent_b = sent_trajectories(stack, a_id), sent_trajectories(stack, b_id)
    for step in range(1, LAG_STEPS + 1):
        version = max(0, step - 1 - k)
        assert {t.policy_version for t in sent_a[step]} == {version}, step
        assert without_run_id(sent_a[step]) == without_run_id(sent_b[step])
        m = a[step - 1]
        if version == step - 1:
            assert m["logprob_abs_diff_max"] == 0.0 and m["iw_mean"] == 1.0, (step, m)
        else:
            assert m["logprob_abs_diff_max"] > 0.0, (step, m)
