"""The multi-rank (FSDP2) trainer on CPU (gloo), ranks as real processes.

Against one process on the same step: the metrics are bitwise equal except
grad_norm (each microbatch's forward runs on the same weights; gradients are
reduce-scattered in another order than one process accumulates them), the
float32 masters after the update equal to rounding; two groups agree bit for
bit over several steps; a checkpoint resumes the group exactly; a refused step
is refused by every rank and leaves the group usable; with bf16 compute an
lr=1e-6 step moves the float32 masters.
"""
from __future__ import annotations

import json

import pytest
import torch
from trainer_support import on_policy_request

from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import FailedPrecondition, InvalidRequest, StepRequest
from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")
# A small budget: each step splits into several microbatches (not a multiple of the ranks), spread over them.
CONFIG = {"lr": 1e-2, "microbatch_tokens": 12, "grad_clip": 1.0}


def step_request(trainer, model_dir, step: int) -> StepRequest:
    return on_policy_request(trainer, model_dir, step, n_groups=3, per_group=3, seed=10)


def _steps(trainer, model_dir, first: int, last: int) -> list[dict]:
    return [trainer.train_step(step_request(trainer, model_dir, s)).metrics for s in range(first, last + 1)]


def _configure(trainer, model_dir, config=CONFIG, resume: str = ""):
    trainer.configure(run_id="run", model_path=str(model_dir), seed=5, config_json=json.dumps(config),
                      resume_checkpoint=resume)
    return trainer


def _group(world: int) -> GroupTrainer:
    return GroupTrainer(GroupSpec(world_size=world, device="cpu", num_threads=1, timeout_s=120))


def _group_run(model_dir, world: int, steps: int, config=CONFIG):
    group = _group(world)
    try:
        # Every rank refuses a digest before a run is configured, and the group stays in step.
        with pytest.raises(FailedPrecondition, match="no run configured"):
            group.weights_digest()
        _configure(group, model_dir, config)
        metrics = _steps(group, model_dir, 1, steps)
        digest = group.weights_digest()
        weights = group.master_state_dict()
        with pytest.raises(InvalidRequest, match="token id 999 >= vocab size"):
            bad = TrainSample("x", "g", torch.tensor([3]), torch.tensor([999]), torch.tensor([-1.0]), 1.0, 0.5)
            group.train_step(StepRequest("run", steps + 1, steps, [bad]))
        assert not group.broken and group.run.policy_version == steps  # every rank refused it, nothing moved
        assert group.weights_digest() == digest
        return metrics, digest, weights
    finally:
        group.close()


def test_two_ranks_match_one_process_and_each_other(tiny_model_dir):
    single = _configure(Trainer(num_threads=1), tiny_model_dir)
    m1 = _steps(single, tiny_model_dir, 1, 1)[0]
    w1 = single.master_state_dict()

    m2, digest, w2 = _group_run(tiny_model_dir, world=2, steps=1)
    step1 = m2[0]
    assert {k: v for k, v in step1.items() if k != "grad_norm"} == {k: v for k, v in m1.items() if k != "grad_norm"}
    assert step1["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    assert w2.keys() == w1.keys()
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)

    again, digest_again, w2b = _group_run(tiny_model_dir, world=2, steps=1)
    assert again == m2 and digest_again == digest
    assert all(torch.equal(w2b[k], w2[k]) for k in w2)


def test_three_ranks_reproduce_over_several_steps(tiny_model_dir):
    single = _configure(Trainer(num_threads=1), tiny_model_dir)
    m1 = _steps(single, tiny_model_dir, 1, 1)[0]
    metrics, digest, _ = _group_run(tiny_model_dir, world=3, steps=3)
    assert {k: v for k, v in metrics[0].items() if k != "grad_norm"} == {k: v for k, v in m1.items() if k != "grad_norm"}
    again, digest_again, _ = _group_run(tiny_model_dir, world=3, steps=3)
    assert again == metrics and digest_again == digest
    assert all(m["tokens_response"] > 0 for m in metrics)


def test_a_group_resumes_from_its_checkpoint_exactly(tiny_model_dir, tmp_path):
    group = _group(2)
    try:
        _configure(group, tiny_model_dir)
        _steps(group, tiny_model_dir, 1, 2)
        path, version = group.save_checkpoint("run", str(tmp_path / "step_2"))
        assert version == 2
        uninterrupted = _steps(group, tiny_model_dir, 3, 4)
        final = group.master_state_dict()
    finally:
        group.close()
    resumed = _group(2)
    try:
        _configure(resumed, tiny_model_dir, resume=str(path))
        assert resumed.run.policy_version == 2
        assert _steps(resumed, tiny_model_dir, 3, 4) == uninterrupted
        assert all(torch.equal(v, final[k]) for k, v in resumed.master_state_dict().items())
    finally:
        resumed.close()
    # The checkpoint is world-size independent: one process resumes it and steps on the same weights.
    single = _configure(Trainer(num_threads=1), tiny_model_dir, resume=str(path))
    assert single.run.policy_version == 2
    m3 = single.train_step(step_request(single, tiny_model_dir, 3)).metrics
    assert {k: v for k, v in m3.items() if k != "grad_norm"} == \
        {k: v for k, v in uninterrupted[0].items() if k != "grad_norm"}


def test_bf16_compute_moves_the_fp32_masters_of_a_group(tiny_model_dir):
    config = {**CONFIG, "lr": 1e-6, "dtype": "bfloat16"}
    group = _group(2)
    try:
        _configure(group, tiny_model_dir, config)
        before = group.master_state_dict()
        assert {v.dtype for v in before.values()} == {torch.float32}
        _steps(group, tiny_model_dir, 1, 1)
        after = group.master_state_dict()
    finally:
        group.close()
    moved = sum(int((after[k] != v).sum()) for k, v in before.items())
    total = sum(v.numel() for v in before.values())
    # lr 1e-6 is below half a bf16 ulp of most weights: bf16 masters would keep ~1% of them moving.
    assert moved / total > 0.9
