"""The data-parallel trainer group on CPU (gloo), ranks as real processes.

Against one process on the same steps: the step's metrics are bitwise equal
except grad_norm (gradients are summed in another order), the weights equal
to float rounding; two groups agree bit for bit; the replicas stay equal; a
refused step is refused by every rank and leaves the group usable.
"""
from __future__ import annotations

import json

import pytest
import torch
from trainer_support import make_episodes, rollout_logprobs

from services.trainer.batching import TrainSample
from services.trainer.grpo import group_advantages
from services.trainer.trainer import Trainer
from services.trainer.wire import FailedPrecondition, InvalidRequest, StepRequest
from services.trainer.worker_group import GroupSpec, GroupTrainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")
# A small budget: each step splits into several microbatches, spread over the ranks.
CONFIG = json.dumps({"lr": 1e-2, "microbatch_tokens": 12, "grad_clip": 1.0})


def _steps(trainer, n: int) -> list[dict]:
    out = []
    for step in range(1, n + 1):
        eps = make_episodes(n_groups=3, per_group=3, seed=10 + step)
        adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
        samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                               torch.tensor(rollout_logprobs(trainer.run.model, e["prompt"], e["response"])),
                               e["reward"], a) for e, a in zip(eps, adv)]
        out.append(trainer.train_step(StepRequest("run", step, step - 1, samples)).metrics)
    return out


def _configure(trainer, model_dir):
    trainer.configure(run_id="run", model_path=str(model_dir), seed=5, config_json=CONFIG)
    return trainer


def _group_run(model_dir, world: int, steps: int):
    group = GroupTrainer(GroupSpec(world_size=world, device="cpu", num_threads=1, timeout_s=120))
    try:
        # Every rank refuses a digest before a run is configured, and the group stays in step.
        with pytest.raises(FailedPrecondition, match="no run configured"):
            group.replica_digests()
        _configure(group, model_dir)
        metrics = _steps(group, steps)
        digests = group.replica_digests()
        weights = {k: v.clone() for k, v in group.run.model.state_dict().items()}
        with pytest.raises(InvalidRequest, match="token id 999 >= vocab size"):
            bad = TrainSample("x", "g", torch.tensor([3]), torch.tensor([999]), torch.tensor([-1.0]), 1.0, 0.5)
            group.train_step(StepRequest("run", steps + 1, steps, [bad]))
        assert not group.broken and group.run.policy_version == steps  # every rank refused it, nothing moved
        return metrics, digests, weights
    finally:
        group.close()


def test_two_ranks_match_one_process_and_each_other(tiny_model_dir):
    single = _configure(Trainer(num_threads=1), tiny_model_dir)
    m1 = _steps(single, 1)[0]
    w1 = {k: v.clone() for k, v in single.run.model.state_dict().items()}

    m2, digests, w2 = _group_run(tiny_model_dir, world=2, steps=1)
    assert len(digests) == 2 and len(set(digests)) == 1  # replicas bitwise equal
    step1 = m2[0]
    assert {k: v for k, v in step1.items() if k != "grad_norm"} == {k: v for k, v in m1.items() if k != "grad_norm"}
    assert step1["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)

    again, digests_again, w2b = _group_run(tiny_model_dir, world=2, steps=1)
    assert again == m2 and digests_again == digests
    assert all(torch.equal(w2b[k], w2[k]) for k in w2)


def test_three_ranks_over_several_steps_stay_in_step(tiny_model_dir):
    metrics, digests, _ = _group_run(tiny_model_dir, world=3, steps=3)
    assert len(set(digests)) == 1 and len(digests) == 3
    assert [round(m["tokens_response"]) > 0 for m in metrics] == [True] * 3
