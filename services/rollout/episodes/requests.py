"""GenerateRequest.episode <-> multi-turn episodes (services/rollout/episodes/runner.py): validation and the wire.

Every error is a ValueError naming the field (the server answers INVALID_ARGUMENT); an environment is
named, never imported from the request: only registered environments run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import ValidationError

from contract.environment import EpisodeLimits, EpisodeProblem
from proto import lockstep_pb2 as pb
from services.common.bounded_json import loads_bounded
from services.common.tensors import ids_to_proto, logprobs_to_proto, to_proto
from services.environments.registry import environment_options
from services.rollout.episodes.runner import Episode, EpisodeSpec
from services.rollout.types import SamplingConfig
from services.rollout.wire import MAX_SAMPLES_PER_PROMPT, MAX_SEED, sampling_from_proto

MAX_SETTINGS_BYTES = 64 * 1024
MAX_PROBLEM_CHARS = 64 * 1024


@dataclass(frozen=True)
class EpisodeRequest:
    environment: str
    options: dict
    limits: EpisodeLimits
    specs: tuple[EpisodeSpec, ...]
    sampling: SamplingConfig
    samples_per_prompt: int


def _options_error(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors())


def episode_request_from_proto(req: pb.GenerateRequest) -> EpisodeRequest:
    settings = req.episode
    if not req.prompts:
        raise ValueError("prompts: empty")
    if not req.HasField("sampling"):
        raise ValueError("sampling: missing")
    if req.resumed:
        raise ValueError("resumed: an episode request cannot continue paused samples")
    if req.sample_ids:
        raise ValueError("sample_ids: an episode request generates every sample of its prompts")
    if not 1 <= req.samples_per_prompt <= MAX_SAMPLES_PER_PROMPT:
        raise ValueError(f"samples_per_prompt: must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {req.samples_per_prompt}")
    sampling = sampling_from_proto(req.sampling)
    options = loads_bounded(settings.options_json or "{}", field="episode.options_json", max_bytes=MAX_SETTINGS_BYTES)
    if not isinstance(options, dict):
        raise ValueError("episode.options_json: must be a JSON object")
    try:
        environment_options(settings.environment, options)
    except ValidationError as exc:
        raise ValueError(f"episode.options_json: {_options_error(exc)}") from None
    except ValueError as exc:
        raise ValueError(f"episode.environment: {exc}") from None
    limits_raw = loads_bounded(settings.limits_json or "{}", field="episode.limits_json", max_bytes=MAX_SETTINGS_BYTES)
    try:
        limits = EpisodeLimits.model_validate(limits_raw, strict=True)
    except ValidationError as exc:
        raise ValueError(f"episode.limits_json: {_options_error(exc)}") from None
    specs: list[EpisodeSpec] = []
    seen: set[str] = set()
    for i, p in enumerate(req.prompts):
        field = f"prompts[{i}]"
        if not p.group_id:
            raise ValueError(f"{field}.group_id: empty")
        if p.group_id in seen:
            raise ValueError(f"{field}.group_id: duplicate {p.group_id!r}")
        seen.add(p.group_id)
        if p.HasField("token_ids") and p.token_ids.shape and p.token_ids.shape[0]:
            raise ValueError(f"{field}.token_ids: must be empty in an episode request (the environment writes "
                             "the prompt)")
        if not p.HasField("problem"):
            raise ValueError(f"{field}.problem: missing in an episode request")
        for name in ("problem_id", "prompt", "answer"):
            if len(getattr(p.problem, name)) > MAX_PROBLEM_CHARS:
                raise ValueError(f"{field}.problem.{name}: longer than {MAX_PROBLEM_CHARS} characters")
        if p.seed + req.samples_per_prompt - 1 > MAX_SEED:
            raise ValueError(f"{field}.seed: seed + samples_per_prompt - 1 exceeds 2**64 - 1")
        problem = EpisodeProblem(p.problem.problem_id, p.problem.prompt, p.problem.answer)
        specs += [EpisodeSpec(p.group_id, k, problem, int(p.seed) + k) for k in range(req.samples_per_prompt)]
    return EpisodeRequest(settings.environment, options, limits, tuple(specs), sampling, int(req.samples_per_prompt))


def episodes_to_proto(episodes: list[Episode], policy_version: int) -> list[pb.Sample]:
    """One Sample per episode. An episode without a model token (its environment failed in reset()) comes
    back with no tokens and its end_reason, for the coordinator to count and drop."""
    import torch

    out = []
    for e in episodes:
        model_tokens = sum(e.response_mask)
        if len(e.logprobs) != model_tokens or len(e.response_mask) != len(e.response_ids):
            raise RuntimeError(f"episode {e.sample_id}: {len(e.logprobs)} log-probs, {model_tokens} model tokens, "
                               f"{len(e.response_mask)} mask values for {len(e.response_ids)} response tokens")
        if not all(math.isfinite(v) for v in e.logprobs):
            raise RuntimeError(f"episode {e.sample_id}: non-finite log-probs")
        assert e.end_reason is not None
        out.append(pb.Sample(
            group_id=e.group_id, sample_id=e.sample_id, index=e.index,
            response_token_ids=ids_to_proto(e.response_ids), logprobs=logprobs_to_proto(e.logprobs),
            finish_reason="stop", policy_versions=[policy_version] * model_tokens,
            prompt_token_ids=ids_to_proto(e.prompt_ids),
            response_mask=to_proto(torch.tensor(e.response_mask, dtype=torch.bool)),
            episode_reward=e.reward, turns=e.turns, end_reason=e.end_reason.value, tool_calls=e.tool_calls,
            tool_errors=e.tool_errors, turn_rewards=e.turn_rewards))
    return out
