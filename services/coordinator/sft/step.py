"""The step of a supervised run (kind: sft): a seeded batch of the dataset's examples, trained on their
completion tokens, through the same TrainStep, weight sync, evaluation, checkpoints and records as an RL step.

Which examples step s trains is a function of (seed, s) alone: the examples are taken in a seeded shuffle,
epoch after epoch, batch_size at a time, so a resumed or recomputed step trains the same ones. Nothing is
sampled: each trajectory's rollout log-probs are zeros, its reward and advantage 0 (the trainer's objective
'sft' reads none of them), and the replicas are synced after each step only because evaluations sample.
"""
from __future__ import annotations

import random

from contract.wire_tensors import array_to_proto, ids_to_proto, logprobs_to_proto
from proto import lockstep_pb2 as pb
from services.coordinator.run.errors import RunFailed
from services.coordinator.run.prompts import derived_seed
from services.coordinator.run.step_context import StepContext
from services.coordinator.sft.dataset import SftExample
from services.coordinator.state.event_log import PhaseTimer


def step_examples(num_examples: int, *, seed: int, step: int, batch_size: int) -> list[int]:
    """Indices of the examples step `step` (1-based) trains: positions (step-1)*B .. step*B-1 of the
    concatenated seeded shuffles of every epoch."""
    orders: dict[int, list[int]] = {}
    out = []
    for position in range((step - 1) * batch_size, step * batch_size):
        epoch, offset = divmod(position, num_examples)
        if epoch not in orders:
            orders[epoch] = list(range(num_examples))
            random.Random(derived_seed(seed, "sft", epoch)).shuffle(orders[epoch])
        out.append(orders[epoch][offset])
    return out


def example_trajectory(run_id: str, step: int, k: int, index: int, example: SftExample) -> pb.Trajectory:
    model_tokens = sum(example.loss_mask) if example.loss_mask is not None else len(example.response_ids)
    t = pb.Trajectory(run_id=run_id, step=step, policy_version=step - 1, group_id=f"s{step}e{k}",
                      sample_id=f"s{step}e{k}/{index}", prompt_token_ids=ids_to_proto(example.prompt_ids),
                      response_token_ids=ids_to_proto(example.response_ids),
                      rollout_logprobs=logprobs_to_proto([0.0] * model_tokens), reward=0.0, advantage=0.0,
                      finish_reason="stop")
    if example.loss_mask is not None:
        t.response_mask.CopyFrom(array_to_proto(example.loss_mask, "bool"))
    return t


class SftStep:
    def __init__(self, ctx: StepContext, examples: list[SftExample]) -> None:
        if not examples:
            raise RunFailed("sft: the dataset holds no examples")
        self.ctx, self.examples = ctx, examples

    async def replicas_start(self, trainer_version: int) -> int:
        return trainer_version

    async def stop(self) -> None:
        return None

    def trajectories(self, step: int) -> list[pb.Trajectory]:
        spec = self.ctx.spec
        chosen = step_examples(len(self.examples), seed=spec.seed, step=step, batch_size=spec.sft.batch_size)
        return [example_trajectory(self.ctx.run_id, step, k, i, self.examples[i]) for k, i in enumerate(chosen)]

    async def run_step(self, step: int, trainer_version: int) -> None:
        ctx = self.ctx
        await ctx.fleet.readmit(step, trainer_version)
        timer = PhaseTimer()
        header = ctx.header(step)
        if trainer_version == step:
            result, counts = await ctx.trainer.replay(header)
        elif trainer_version == step - 1:
            trajectories = self.trajectories(step)
            counts = {"trajectories_trained": len(trajectories), "trajectories_dropped": 0}
            result, _ = await ctx.train(header, trajectories, counts, timer)
        else:
            raise RunFailed(f"step {step}: trainer holds policy version {trainer_version}, expected {step - 1}")
        with timer.phase("weight_sync"):
            await ctx.fleet.sync_weights(step)
        metrics = {**result.metrics, **counts}
        report = await ctx.eval_and_checkpoint(step, timer, metrics)
        await ctx.record(step, metrics, timer.finish(), counts, report)
