"""Pure conversions between the wire (proto) and the engine interface, with validation.

Every error is a ValueError whose message starts with the offending field
(`prompts[2].token_ids: empty`); the servicer maps it to INVALID_ARGUMENT.
No state, no I/O: the servicer passes everything in.
"""
from __future__ import annotations

import json
import math

import torch

from proto import lockstep_pb2 as pb
from services.common.bounded_json import loads_bounded
from services.common.tensors import from_proto, ids_to_proto, logprobs_to_proto, to_proto
from services.rollout.types import GeneratedSample, GenerationRequest, PromptSpec, ResumedSample, SamplingConfig

# Key of engine_config_json that selects the engine; every other key is the
# engine's own option and is validated by that engine's config.
ENGINE_KEY = "engine"
MAX_ENGINE_CONFIG_BYTES = 1024 * 1024
MAX_SAMPLES_PER_PROMPT = 65536
MAX_SEED = 2**64 - 1


def split_engine_config(engine_config_json: str, default_engine: str) -> tuple[str, str]:
    """`{"engine": "torch", "dtype": "float32"}` -> ("torch", '{"dtype": "float32"}').

    The engine name is optional (the service's configured engine is used);
    an empty string means no options.
    """
    text = engine_config_json.strip()
    if not text:
        return default_engine, "{}"
    raw = loads_bounded(text, field="engine_config_json", max_bytes=MAX_ENGINE_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ValueError(f"engine_config_json: expected a JSON object, got {type(raw).__name__}")
    name = raw.pop(ENGINE_KEY, default_engine)
    if not isinstance(name, str) or not name:
        raise ValueError(f"engine_config_json.{ENGINE_KEY}: expected a non-empty string, got {name!r}")
    return name, json.dumps(raw)


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingConfig:
    stop = tuple(int(t) for t in msg.stop_token_ids)
    if any(t < 0 for t in stop):
        raise ValueError(f"sampling.stop_token_ids: negative id {min(stop)}")
    cfg = SamplingConfig(
        temperature=float(msg.temperature),
        top_p=float(msg.top_p),
        top_k=int(msg.top_k),
        max_new_tokens=int(msg.max_new_tokens),
        stop_token_ids=stop,
        greedy=bool(msg.greedy),
    )
    cfg.validate()
    return cfg


def generation_request_from_proto(req: pb.GenerateRequest) -> GenerationRequest:
    """Validate a GenerateRequest and convert it; ValueError names the first bad field."""
    if not req.prompts:
        raise ValueError("prompts: empty")
    if not req.HasField("sampling"):
        raise ValueError("sampling: missing")
    if not 1 <= req.samples_per_prompt <= MAX_SAMPLES_PER_PROMPT:
        raise ValueError(f"samples_per_prompt: must be in [1, {MAX_SAMPLES_PER_PROMPT}], got {req.samples_per_prompt}")
    sampling = sampling_from_proto(req.sampling)
    prompts: list[PromptSpec] = []
    seen: set[str] = set()
    for i, p in enumerate(req.prompts):
        field = f"prompts[{i}]"
        if not p.group_id:
            raise ValueError(f"{field}.group_id: empty")
        if p.group_id in seen:
            # sample ids are "<group_id>/<index>": a repeated group id would make them ambiguous.
            raise ValueError(f"{field}.group_id: duplicate {p.group_id!r}")
        seen.add(p.group_id)
        ids = from_proto(p.token_ids, field=f"{field}.token_ids", dtype=torch.int32, ndim=1)
        if ids.numel() == 0:
            raise ValueError(f"{field}.token_ids: empty")
        if bool((ids < 0).any()):
            raise ValueError(f"{field}.token_ids: negative id {int(ids.min())}")
        if p.seed + req.samples_per_prompt - 1 > MAX_SEED:
            raise ValueError(f"{field}.seed: seed + samples_per_prompt - 1 exceeds 2**64 - 1")
        prompts.append(PromptSpec(group_id=p.group_id, token_ids=tuple(ids.tolist()), seed=int(p.seed)))
    resumed = resumed_from_proto(req, prompts, sampling)
    return GenerationRequest(prompts=tuple(prompts), sampling=sampling, samples_per_prompt=int(req.samples_per_prompt),
                             resumed=resumed, sample_ids=sample_ids_from_proto(req, prompts, resumed))


def request_sample_ids(prompts: list[PromptSpec], samples_per_prompt: int) -> set[str]:
    """Every "<group_id>/<index>" a request of these prompts can name."""
    return {f"{p.group_id}/{i}" for p in prompts for i in range(samples_per_prompt)}


def sample_ids_from_proto(req: pb.GenerateRequest, prompts: list[PromptSpec],
                          resumed: tuple[ResumedSample, ...]) -> tuple[str, ...]:
    """GenerateRequest.sample_ids: samples of this request, each once, every resumed one and at least one of
    each prompt among them (a prompt with nothing to generate is a caller's mistake)."""
    if not req.sample_ids:
        return ()
    known = request_sample_ids(prompts, req.samples_per_prompt)
    seen: set[str] = set()
    for i, sample_id in enumerate(req.sample_ids):
        if sample_id not in known:
            raise ValueError(f"sample_ids[{i}]: {sample_id!r} is not a sample of this request")
        if sample_id in seen:
            raise ValueError(f"sample_ids[{i}]: duplicate {sample_id!r}")
        seen.add(sample_id)
    for i, r in enumerate(resumed):
        if r.sample_id not in seen:
            raise ValueError(f"resumed[{i}].sample_id: {r.sample_id!r} is continued but not in sample_ids")
    for i, p in enumerate(prompts):
        if not any(f"{p.group_id}/{k}" in seen for k in range(req.samples_per_prompt)):
            raise ValueError(f"prompts[{i}]: none of its samples is in sample_ids")
    return tuple(req.sample_ids)


def resumed_from_proto(req: pb.GenerateRequest, prompts: list[PromptSpec],
                       sampling: SamplingConfig) -> tuple[ResumedSample, ...]:
    """GenerateRequest.resumed, each naming a sample of this request once, with R < max_new_tokens tokens."""
    known = request_sample_ids(prompts, req.samples_per_prompt)
    out, seen = [], set()
    for i, r in enumerate(req.resumed):
        field = f"resumed[{i}]"
        if r.sample_id not in known:
            raise ValueError(f"{field}.sample_id: {r.sample_id!r} is not a sample of this request")
        if r.sample_id in seen:
            raise ValueError(f"{field}.sample_id: duplicate {r.sample_id!r}")
        seen.add(r.sample_id)
        ids = from_proto(r.response_token_ids, field=f"{field}.response_token_ids", dtype=torch.int32, ndim=1)
        logps = from_proto(r.logprobs, field=f"{field}.logprobs", dtype=torch.float32, ndim=1)
        versions = [int(v) for v in r.policy_versions]
        if not (ids.numel() == logps.numel() == len(versions)):
            raise ValueError(f"{field}: {ids.numel()} tokens, {logps.numel()} log-probs and {len(versions)} "
                             "policy versions (one each per token)")
        if bool((ids < 0).any()):
            raise ValueError(f"{field}.response_token_ids: negative id {int(ids.min())}")
        if ids.numel() >= sampling.max_new_tokens:
            raise ValueError(f"{field}.response_token_ids: {ids.numel()} tokens already reach "
                             f"sampling.max_new_tokens={sampling.max_new_tokens}")
        if not bool(torch.isfinite(logps).all()):
            raise ValueError(f"{field}.logprobs: non-finite values")
        out.append(ResumedSample(r.sample_id, tuple(ids.tolist()), tuple(logps.tolist()), tuple(versions)))
    return tuple(out)


def samples_to_proto(samples: list[GeneratedSample], policy_version: int) -> list[pb.Sample]:
    """Engine output -> wire, refusing (RuntimeError: an engine bug, not a bad request) anything malformed.
    A sample without per-token versions was sampled entirely under `policy_version`."""
    out = []
    for s in samples:
        if len(s.token_ids) != len(s.logprobs) or (not s.token_ids and s.finish_reason != "paused"):
            raise RuntimeError(
                f"engine returned {s.sample_id} with {len(s.token_ids)} tokens and {len(s.logprobs)} log-probs"
            )
        if not all(math.isfinite(v) for v in s.logprobs):
            raise RuntimeError(f"engine returned non-finite log-probs for {s.sample_id}")
        if s.policy_versions and len(s.policy_versions) != len(s.token_ids):
            raise RuntimeError(f"engine returned {s.sample_id} with {len(s.policy_versions)} policy versions for "
                               f"{len(s.token_ids)} tokens")
        if s.finish_reason not in ("stop", "length", "paused"):
            raise RuntimeError(f"engine returned finish_reason {s.finish_reason!r} for {s.sample_id}")
        out.append(
            pb.Sample(
                group_id=s.group_id,
                sample_id=s.sample_id,
                index=s.index,
                response_token_ids=ids_to_proto(s.token_ids),
                logprobs=logprobs_to_proto(s.logprobs),
                finish_reason=s.finish_reason,
                policy_versions=s.policy_versions or [policy_version] * len(s.token_ids),
                **({"routed_experts": to_proto(s.routed_experts)} if s.routed_experts is not None else {}),
            )
        )
    return out


def check_sample_order(request: GenerationRequest, samples: list[GeneratedSample]) -> None:
    """The engine must return prompts in order, each with indices 0..n-1, or those of them sample_ids names
    (the coordinator relies on it)."""
    expected = [(p.group_id, i) for p, i in request.sequences()]
    got = [(s.group_id, s.index) for s in samples]
    if got != expected:
        raise RuntimeError(f"engine returned {len(got)} samples out of order or incomplete ({len(expected)} expected)")
