"""bench/moe_train.py --small on CPU: the JSON it prints has the limits, the grouped GEMM probe (the
batch-invariant reference bitwise for one expert's rows alone) and a real Trainer step in both numerics modes
with step-1 IW exactly 1 and the MoE metrics. No timing is asserted."""
from __future__ import annotations

import pytest
import torch

from bench.moe_train import main


@pytest.fixture
def restore_torch_globals():
    """The Trainer sets process-wide determinism and thread count; later tests must not inherit them."""
    det, threads = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(det)
    torch.set_num_threads(threads)


def test_small_mode_runs_the_whole_bench(tmp_path, restore_torch_globals):
    out = main(["--small", "--numerics", "fast,true_on_policy", "--out", str(tmp_path / "moe.json")])
    assert (tmp_path / "moe.json").read_text().startswith("{")
    assert out["dense_gemm_tflops"] > 0 and out["copy_gbps"] > 0
    for projection in out["grouped_gemm"]["projections"].values():
        assert projection["reference"]["expert_rows_alone_bitwise"] is True
        assert projection["grouped_mm"]["ms"] > 0
    assert [r["numerics"] for r in out["train"]] == ["fast", "true_on_policy"]
    for run in out["train"]:
        assert run["step1_iw_min_max"] == [1.0, 1.0]
        assert run["active_non_embedding_params"] < run["non_embedding_params"]
        assert run["mfu"] > 0
    assert out["train"][1]["step1_logprob_abs_diff_max"] == 0.0
    for run in out["train"]:
        moe = run["moe_metrics_last_step"]
        assert moe["moe_dropped_tokens"] == 0.0 and moe["moe_expert_load_max"] >= moe["moe_expert_load_mean"] > 0
