"""Three fixed training steps, sent over gRPC to a trainer service or run on one rank in this process: what
the tests of a trainer placed as several ranks compare with one rank.

The trajectories are fixed by the step number (tests/trainer/trainer_support.py's episodes, scored by the
model as it starts), so every trainer sees the same bytes whatever it did before. Microbatches of 12
tokens split each step into several, more than there are ranks, spread over the ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.auth import BearerToken
from services.common.grpc.options import sync_channel
from services.common.tensors import ids_to_proto, logprobs_to_proto
from services.trainer.data.wire import StepRequest, decode_trajectory
from services.trainer.loss.surrogate import group_advantages
from tests.trainer.trainer_support import make_episodes, rollout_logprobs

RPC_CEILING_S = 600
CONFIG = {"lr": 1e-2, "microbatch_tokens": 12, "grad_clip": 1.0}
RUN, SEED, STEPS = "ranks-parity", 5, 3


def step_chunks(model_dir: Path) -> list[list[pb.TrainStepChunk]]:
    """The TrainStep stream of each step 1..STEPS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    streams = []
    for step in range(1, STEPS + 1):
        eps = make_episodes(n_groups=3, per_group=3, seed=10 + step)
        adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
        trajs = [pb.Trajectory(
            run_id=RUN, step=step, policy_version=step - 1, group_id=e["group_id"], sample_id=e["sample_id"],
            prompt_token_ids=ids_to_proto(e["prompt"]), response_token_ids=ids_to_proto(e["response"]),
            rollout_logprobs=logprobs_to_proto(rollout_logprobs(model, e["prompt"], e["response"])),
            reward=e["reward"], advantage=a, finish_reason="length") for e, a in zip(eps, adv)]
        header = pb.TrainStepHeader(run_id=RUN, step=step, policy_version=step - 1, num_trajectories=len(trajs))
        streams.append([pb.TrainStepChunk(header=header), *(pb.TrainStepChunk(trajectory=t) for t in trajs)])
    return streams


def one_rank_metrics(model_dir: Path, streams: list[list[pb.TrainStepChunk]]) -> list[dict[str, float]]:
    """The steps on a one-rank Trainer in this process (torch's thread count and determinism put back)."""
    from services.trainer.trainer import Trainer

    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        trainer = Trainer(num_threads=1)
        trainer.configure(run_id=RUN, model_path=str(model_dir), seed=SEED, config_json=json.dumps(CONFIG))
        out = []
        for chunks in streams:
            header = chunks[0].header
            samples = [decode_trajectory(c.trajectory, i, header) for i, c in enumerate(chunks[1:])]
            out.append(trainer.train_step(StepRequest(RUN, header.step, header.policy_version, samples)).metrics)
        return out
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)


def grpc_metrics(address: str, token: BearerToken, model_dir: Path,
                 streams: list[list[pb.TrainStepChunk]]) -> list[dict[str, float]]:
    """The steps on the trainer serving at `address`, as its TrainStep answers report them."""
    # Deadlines are ceilings for a hung trainer, never waited out by a healthy one: four ranks configure in
    # seconds alone but took over 120 s on CI's two cores beside the unit and stack processes.
    channel = sync_channel(address, token)
    try:
        stub = pb_grpc.TrainerStub(channel)
        stub.Health(pb.HealthRequest(), timeout=RPC_CEILING_S, wait_for_ready=True)
        stub.ConfigureRun(pb.ConfigureRunRequest(run_id=RUN, model_path=str(model_dir), seed=SEED,
                                                 trainer_config_json=json.dumps(CONFIG)), timeout=RPC_CEILING_S)
        return [dict(stub.TrainStep(iter(chunks), timeout=RPC_CEILING_S).metrics) for chunks in streams]
    finally:
        channel.close()


def assert_like_one_rank(got: list[dict[str, float]], one: list[dict[str, float]]) -> None:
    """Step 1 starts from the same weights on any world size and every microbatch's forward runs on them:
    every metric but grad_norm is bitwise one rank's (services/trainer/distributed/data_parallel.py). The gradients are
    summed in another order than one rank accumulates them, so the weights after step 1 -- and the metrics
    of steps 2 and 3, computed from them -- equal one rank's only up to float32 rounding of that sum: those
    are compared to a relative 1e-4, orders of magnitude above a few float32 ulps and far below any change
    in what is trained."""
    assert len(got) == len(one) == STEPS
    assert {k: v for k, v in got[0].items() if k != "grad_norm"} == \
        {k: v for k, v in one[0].items() if k != "grad_norm"}
    for g, o in zip(got[1:], one[1:]):
        assert g.keys() == o.keys()
        for k in o:
            assert g[k] == pytest.approx(o[k], rel=1e-4, abs=1e-6), (k, g[k], o[k])

