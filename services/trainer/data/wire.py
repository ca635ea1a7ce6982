"""Decoding and validating TrainStep streams (pure helpers, no servicer state).

Every error is an `InvalidRequest` whose message starts with the offending
field, e.g. 'trajectory[3].rollout_logprobs: 5 values for 6 response tokens',
so the server can answer INVALID_ARGUMENT and keep serving.
"""
from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from contract.wire_tensors import array_from_proto
from proto import lockstep_pb2 as pb
from services.common.tensors import from_proto
from services.trainer.data.batching import TrainSample
from services.trainer.data.token_versions import check_header_bound, check_token_versions
from services.trainer.data.wire_errors import FailedPrecondition, InvalidRequest

__all__ = ["FailedPrecondition", "InvalidRequest", "StepRequest", "check_header", "decode_trajectory",
           "read_train_step", "step_metrics_message"]

# Log-probs are <= 0 by construction (logit - logsumexp with the max inside
# the sum). A positive value means the sender shipped something else (probs,
# logits); the slack only absorbs a foreign implementation's rounding.
LOGPROB_POSITIVE_SLACK = 1e-4


@dataclass(frozen=True)
class StepRequest:
    run_id: str
    step: int
    policy_version: int
    samples: list[TrainSample]
    keep_previous_weights: bool = False  # the header's: serve version step - 1 while the step trains


def check_header(header: pb.TrainStepHeader) -> None:
    if not header.run_id:
        raise InvalidRequest("header.run_id: empty")
    if header.step < 1:
        raise InvalidRequest(f"header.step: must be >= 1, got {header.step}")
    if not 0 <= header.policy_version <= header.step - 1:
        raise InvalidRequest(
            f"header.policy_version: {header.policy_version} cannot have generated step {header.step} "
            f"(want 0 <= policy_version <= step - 1)"
        )
    # 0 is legal: a replay of an applied step carries no trajectories (the
    # trainer refuses 0 for a step it still has to apply).
    if header.num_trajectories < 0:
        raise InvalidRequest(f"header.num_trajectories: must be >= 0, got {header.num_trajectories}")
    check_header_bound(header.step, header.policy_version, header.max_staleness)


def decode_trajectory(msg: pb.Trajectory, index: int, header: pb.TrainStepHeader) -> TrainSample:
    where = f"trajectory[{index}]"
    if msg.run_id != header.run_id:
        raise InvalidRequest(f"{where}.run_id: {msg.run_id!r} but the header says {header.run_id!r}")
    if msg.step != header.step:
        raise InvalidRequest(f"{where}.step: {msg.step} but the header says {header.step}")
    if not 0 <= msg.policy_version <= header.step - 1:
        raise InvalidRequest(
            f"{where}.policy_version: {msg.policy_version} cannot have generated step {header.step}"
        )
    if not msg.sample_id:
        raise InvalidRequest(f"{where}.sample_id: empty")
    if not msg.group_id:
        raise InvalidRequest(f"{where}.group_id: empty")
    # Checked as numpy arrays (the torch-free contract's decoder) and turned into tensors once: a trajectory is
    # a few dozen values, on which a torch op's dispatch costs several times a numpy call, and every step
    # decodes all of its trajectories before it trains.
    try:
        prompt = array_from_proto(msg.prompt_token_ids, field=f"{where}.prompt_token_ids", dtype="int32", ndim=1)
        response = array_from_proto(msg.response_token_ids, field=f"{where}.response_token_ids", dtype="int32",
                                     ndim=1)
        logprobs = array_from_proto(msg.rollout_logprobs, field=f"{where}.rollout_logprobs", dtype="float32",
                                    ndim=1)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if prompt.size == 0:
        raise InvalidRequest(f"{where}.prompt_token_ids: empty prompt")
    if response.size == 0:
        raise InvalidRequest(f"{where}.response_token_ids: empty response")
    for name, ids in (("prompt_token_ids", prompt), ("response_token_ids", response)):
        if ids.min() < 0:
            raise InvalidRequest(f"{where}.{name}: negative token id {int(ids.min())}")
    mask = None
    if msg.HasField("response_mask"):
        try:
            mask = array_from_proto(msg.response_mask, field=f"{where}.response_mask", dtype="bool", ndim=1)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if mask.size != response.size:
            raise InvalidRequest(f"{where}.response_mask: {mask.size} values for {response.size} response tokens")
        if not mask.any():
            raise InvalidRequest(f"{where}.response_mask: no model token (nothing to train on)")
    model_tokens = response.size if mask is None else int(mask.sum())
    if logprobs.size != model_tokens:
        what = "response tokens" if mask is None else "model tokens (response_mask true)"
        raise InvalidRequest(f"{where}.rollout_logprobs: {logprobs.size} values for {model_tokens} {what}")
    finite = np.isfinite(logprobs)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise InvalidRequest(f"{where}.rollout_logprobs[{bad}]: not finite ({float(logprobs[bad])})")
    if float(logprobs.max()) > LOGPROB_POSITIVE_SLACK:
        bad = int(logprobs.argmax())
        raise InvalidRequest(f"{where}.rollout_logprobs[{bad}]: {float(logprobs[bad])} > 0 is not a log-prob")
    versions = check_token_versions(msg.token_policy_versions, where=where, step=header.step,
                                    trajectory_version=msg.policy_version, num_tokens=model_tokens,
                                    header_version=header.policy_version, max_staleness=header.max_staleness,
                                    streaming=header.streaming)
    staleness_sum = sum(header.step - 1 - v for v in versions)
    for name in ("reward", "advantage"):
        value = getattr(msg, name)
        if not math.isfinite(value):
            raise InvalidRequest(f"{where}.{name}: not finite ({value})")
    routed = _routed_experts(msg, where, prompt.size + response.size)
    return TrainSample(
        sample_id=msg.sample_id,
        group_id=msg.group_id,
        prompt_ids=torch.from_numpy(prompt.astype(np.int64)),
        response_ids=torch.from_numpy(response.astype(np.int64)),
        rollout_logprobs=torch.from_numpy(logprobs),
        reward=float(msg.reward),
        advantage=float(msg.advantage),
        response_mask=None if mask is None else torch.from_numpy(mask),
        staleness_sum=staleness_sum,
        routed_experts=routed,
    )


def _routed_experts(msg: pb.Trajectory, where: str, tokens: int) -> torch.Tensor | None:
    """int64 [P + R, layers, k] with pads as -1 (uint8 pads are 255), or None; the checks against the model
    (ids in range, layers and k, which rows are pad) are the trainer's (services/trainer/model/moe.py)."""
    if not msg.HasField("routed_experts"):
        return None
    field = f"{where}.routed_experts"
    try:
        routed = from_proto(msg.routed_experts, field=field, ndim=3)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if routed.dtype not in (torch.uint8, torch.int32):
        raise InvalidRequest(f"{field}: dtype {routed.dtype} (expert ids travel as uint8, or int32 past 254 experts)")
    if routed.shape[0] != tokens:
        raise InvalidRequest(f"{field}: {routed.shape[0]} rows for {tokens} prompt and response tokens")
    out = routed.long()
    if routed.dtype == torch.uint8:
        out[routed == 255] = -1
    return out


async def read_train_step(stream: AsyncIterator[pb.TrainStepChunk]) -> StepRequest:
    """Consume a TrainStep stream: exactly one header first, then its trajectories."""
    header: pb.TrainStepHeader | None = None
    samples: list[TrainSample] = []
    seen: set[str] = set()
    index = 0
    async for chunk in stream:
        kind = chunk.WhichOneof("item")
        if kind is None:
            raise InvalidRequest(f"message[{index}]: neither header nor trajectory")
        if kind == "header":
            if header is not None:
                raise InvalidRequest(f"message[{index}]: second header (the header must come once, first)")
            header = chunk.header
            check_header(header)
        else:
            if header is None:
                raise InvalidRequest("message[0]: header missing (the first message must be the header)")
            if len(samples) >= header.num_trajectories:
                raise InvalidRequest(
                    f"trajectory[{len(samples)}]: more trajectories than header.num_trajectories={header.num_trajectories}"
                )
            sample = decode_trajectory(chunk.trajectory, len(samples), header)
            if sample.sample_id in seen:
                raise InvalidRequest(f"trajectory[{len(samples)}].sample_id: duplicate {sample.sample_id!r}")
            seen.add(sample.sample_id)
            samples.append(sample)
        index += 1
    if header is None:
        raise InvalidRequest("header missing: empty TrainStep stream")
    if len(samples) != header.num_trajectories:
        raise InvalidRequest(
            f"header.num_trajectories: {header.num_trajectories} announced, {len(samples)} received"
        )
    return StepRequest(header.run_id, header.step, header.policy_version, samples,
                       keep_previous_weights=header.keep_previous_weights)


def step_metrics_message(run_id: str, step: int, policy_version: int, metrics: dict[str, float], *, replayed: bool,
                         sample_weights: Sequence[tuple[str, float, float]] = ()) -> pb.StepMetrics:
    return pb.StepMetrics(
        run_id=run_id, step=step, policy_version=policy_version, metrics=metrics, replayed=replayed,
        sample_weights=[pb.SampleWeights(sample_id=i, iw_min=lo, iw_max=hi) for i, lo, hi in sample_weights],
    )
