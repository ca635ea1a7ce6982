"""HTTP client of an SGLang server, and the pure functions that build its requests.

Request bodies follow sglang 0.5.23 (sglang/srt/managers/io_struct.py:
GenerateReqInput, UpdateWeightFromDiskReqInput, InitWeightsUpdateGroupReqInput,
UpdateWeightsFromDistributedReqInput, DestroyWeightsUpdateGroupReqInput, BeginWeightUpdateReqInput,
EndWeightUpdateReqInput, CheckWeightsReqInput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput,
UpdateWeightVersionReqInput, PauseGenerationReqInput). They are built by plain functions so that each
is checked against those types, including the paths a CPU test server can't exercise (NCCL rather than
gloo under the weight broadcast, LoRA).

Log-probs and temperature (sglang/srt/layers/sampler.py): with a sampling
temperature tau, SGLang reports log(softmax(logits / tau)) of the sampled token,
taken before top-p/top-k renormalisation -- the distribution the trainer
recomputes as log_softmax(logits / tau) (docs/DESIGN.md: temperature is part of
the log-prob definition). Greedy requests are scored at temperature 1. The environment
variable SGLANG_RETURN_ORIGINAL_LOGPROB=1 would switch this to the unscaled
distribution, so the supervisor removes it from the server's environment.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from services.rollout.routed_experts import from_sglang
from services.rollout.types import (
    GeneratedSample, GenerationRequest, ResumedSample, SamplingConfig, check_request_fits_model,
)


@dataclass(frozen=True)
class MoeShape:
    """What a routed-experts table of the served model holds per read position."""

    layers: int
    top_k: int
    n_experts: int


class SGLangConnectionError(RuntimeError):
    """The server did not answer (refused, reset, timed out): it may be dead."""


class SGLangRequestError(RuntimeError):
    """The server answered with an error status or a body that does not fit the contract."""

    def __init__(self, path: str, status: int, body: str):
        super().__init__(f"sglang {path}: HTTP {status}: {body[:2000]}")
        self.path, self.status, self.body = path, status, body


# ---------------------------------------------------------------- builders --

def sampling_params(sampling: SamplingConfig, seed: int) -> dict[str, Any]:
    """SGLang sampling params for one sample.

    - stop_token_ids: a sample stops on the ids the request names; the stop
      token is part of the output and has a log-prob (as in the torch
      engine). SGLang also stops on the model's own eos ids and its only
      switch for that (ignore_eos) disables stop_token_ids too, so the engine
      refuses requests whose stop ids leave the model's eos ids out.
    - greedy is temperature 0 (SGLang then scores at temperature 1).
    - top_k 0 (off in Lockstep) is -1 in SGLang.
    - sampling_seed: honoured by SGLang only under
      --enable-deterministic-inference (sampling_batch_info.py); in fast mode
      samples are drawn from the server's RNG and are not reproducible by seed.
    """
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "min_p": 0.0,
        "ignore_eos": False,
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": seed % 2**63,
    }
    return params


def check_request(request: GenerationRequest, *, vocab: int, max_len: int | None, eos: set[int]) -> None:
    """What the SGLang engine can serve exactly, checked against its model (`vocab` ids, `max_len`
    positions, `eos` ids); ValueError names the field."""
    check_request_fits_model(request, vocab=vocab, max_len=max_len)
    # SGLang stops on the model's eos ids by itself and has no switch for
    # that alone (ignore_eos also disables stop_token_ids). A request that
    # leaves them out would get shorter samples than the torch engine
    # gives: refuse it rather than differ silently.
    missing = sorted(eos - set(request.sampling.stop_token_ids))
    if missing:
        raise ValueError(
            f"sampling.stop_token_ids: the sglang engine always stops at the model's eos ids {sorted(eos)}; "
            f"include {missing}"
        )


def continuation_seed(seed: int, resumed_tokens: int) -> int:
    """The seed of a paused sample's continuation: not its first request's, whose stream would otherwise
    restart at the continuation's first token and repeat the draws the sample already used."""
    return seed if resumed_tokens == 0 else (seed * 1_000_003 + resumed_tokens) % 2**63


def generate_body(request: GenerationRequest, lora_name: str | None = None, *,
                  routed_experts: bool = False) -> dict[str, Any]:
    """One batched /generate body: sample i of prompt p is its own entry, seeded p.seed + i.

    A sample listed in `request.resumed` (paused earlier, see `parse_generate_response`) is continued: its
    entry is the prompt followed by the tokens it has, with the new-token budget they leave. SGLang prefills
    that whole context under the weights it holds now, so every continued token is sampled from the current
    version conditioned on K/V of that version, as the trainer scores it.

    `lora_name`: every sample is served through that loaded adapter (GenerateReqInput.lora_path takes
    the name /load_lora_adapter registered).

    `routed_experts`: ask for every read position's experts (GenerateReqInput.return_routed_experts; the
    server must run with --enable-return-routed-experts), the whole input included."""
    resumed = resumed_by_id(request)
    input_ids: list[list[int]] = []
    params: list[dict[str, Any]] = []
    for prompt, i in request.sequences():
        prefix = resumed.get(f"{prompt.group_id}/{i}")
        have = list(prefix.token_ids) if prefix else []
        input_ids.append(list(prompt.token_ids) + have)
        p = sampling_params(request.sampling, continuation_seed(prompt.seed + i, len(have)))
        p["max_new_tokens"] = request.sampling.max_new_tokens - len(have)
        params.append(p)
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": params,
        "return_logprob": True,
        # Only output-token log-probs: prompt log-probs would cost a full
        # prefill log_softmax and are not used.
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }
    if lora_name is not None:
        body["lora_path"] = [lora_name] * len(input_ids)
    if routed_experts:
        body["return_routed_experts"] = True
    return body


def resumed_by_id(request: GenerationRequest) -> dict[str, ResumedSample]:
    """The request's paused samples by sample id; ValueError naming the field for one it cannot continue."""
    known = {f"{p.group_id}/{i}" for p in request.prompts for i in range(request.samples_per_prompt)}
    out: dict[str, ResumedSample] = {}
    for k, r in enumerate(request.resumed):
        if r.sample_id not in known or r.sample_id in out:
            raise ValueError(f"resumed[{k}].sample_id: {r.sample_id!r} is not a sample of this request, or is twice")
        if not 0 < len(r.token_ids) < request.sampling.max_new_tokens:
            raise ValueError(f"resumed[{k}].response_token_ids: {len(r.token_ids)} tokens; a paused sample has "
                             f"1 to sampling.max_new_tokens - 1 = {request.sampling.max_new_tokens - 1}")
        if not len(r.logprobs) == len(r.policy_versions) == len(r.token_ids):
            raise ValueError(f"resumed[{k}]: {len(r.token_ids)} tokens, {len(r.logprobs)} log-probs, "
                             f"{len(r.policy_versions)} policy versions")
        out[r.sample_id] = r
    return out


def parse_generate_response(
    request: GenerationRequest, outputs: Any, expected_weight_version: str, *, pause_asked: bool = False,
    routing: MoeShape | None = None,
) -> list[GeneratedSample]:
    """Samples in prompt order, then sample index; every one checked against the contract.

    Every token must come from the engine's policy version: SGLang lists the weight versions a request's
    tokens were generated under (meta_info.weight_versions: spans of output positions, recorded by its
    scheduler when a weight update lands on a live request); a span, or a final weight_version, of another
    version is an error. Per-token versions are therefore exact: a continued sample's earlier tokens keep
    the versions they were reported with, and every token of this call is of this version.

    `pause_asked`: the engine aborted this call's requests to pause them (request_pause). A sample that
    SGLang returns aborted then comes back with finish_reason 'paused' and its tokens so far; without a
    pause, an abort is an error like any other finish reason.

    `routing`: the body asked for routed experts; each sample's table is checked and returned
    (services/rollout/routed_experts.py), and one that is missing or malformed is an error.
    """
    resumed = resumed_by_id(request)
    version = int(expected_weight_version)
    seqs = request.sequences()
    if isinstance(outputs, dict):
        outputs = [outputs]
    if not isinstance(outputs, list) or len(outputs) != len(seqs):
        got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
        raise SGLangRequestError("/generate", 200, f"expected {len(seqs)} outputs, got {got}")
    samples = []
    for (prompt, index), out in zip(seqs, outputs, strict=True):
        meta = out.get("meta_info") or {}
        spans = meta.get("weight_versions") or []
        other = [v for v in [meta.get("weight_version"), *(s.get("version") for s in spans)]
                 if v != expected_weight_version]
        if other:
            raise SGLangRequestError(
                "/generate", 200,
                f"sample {prompt.group_id}/{index} was generated with weight_version {other[0]!r}, "
                f"the engine holds policy version {expected_weight_version!r}",
            )
        token_ids = [int(t) for t in out.get("output_ids", [])]
        triples = meta.get("output_token_logprobs") or []
        logprob_ids = [int(t[1]) for t in triples]
        if logprob_ids != token_ids:
            raise SGLangRequestError(
                "/generate", 200,
                f"sample {prompt.group_id}/{index}: output_token_logprobs ids {logprob_ids[:8]}... "
                f"do not match output_ids {token_ids[:8]}...",
            )
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish == "abort" and pause_asked:
            finish = "paused"
        if finish not in ("stop", "length", "paused"):
            raise SGLangRequestError(
                "/generate", 200, f"sample {prompt.group_id}/{index}: finish_reason {meta.get('finish_reason')!r}"
            )
        earlier = resumed.get(f"{prompt.group_id}/{index}")
        routed = None
        if routing is not None:
            tokens = len(prompt.token_ids) + (len(earlier.token_ids) if earlier else 0) + len(token_ids)
            try:
                routed = from_sglang(meta.get("routed_experts"), tokens=tokens, layers=routing.layers,
                                     top_k=routing.top_k, n_experts=routing.n_experts,
                                     where=f"sample {prompt.group_id}/{index}")
            except ValueError as exc:
                raise SGLangRequestError("/generate", 200, str(exc)) from None
        samples.append(
            GeneratedSample(
                group_id=prompt.group_id,
                index=index,
                token_ids=(list(earlier.token_ids) if earlier else []) + token_ids,
                logprobs=(list(earlier.logprobs) if earlier else []) + [float(t[0]) for t in triples],
                finish_reason=finish,
                policy_versions=(list(earlier.policy_versions) if earlier else []) + [version] * len(token_ids),
                routed_experts=routed,
            )
        )
    return samples


def update_weights_from_disk_body(model_path: str, weight_version: str) -> dict[str, Any]:
    return {
        "model_path": model_path,
        "weight_version": weight_version,
        # The radix cache holds KV computed by the old weights: drop it.
        "flush_cache": True,
        "abort_all_requests": False,
    }


def init_weights_update_group_body(
    master_address: str, master_port: int, rank_offset: int, world_size: int,
    group_name: str = "weight_update_group", backend: str = "nccl",
) -> dict[str, Any]:
    """Join the trainer's process group (rank 0 = trainer, SGLang ranks from rank_offset)."""
    if not 0 < master_port < 65536:
        raise ValueError(f"master_port: must be in (0, 65536), got {master_port}")
    if world_size < 2 or not 0 < rank_offset < world_size:
        raise ValueError(f"rank_offset/world_size: need 0 < rank_offset < world_size >= 2, got {rank_offset}/{world_size}")
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def update_weights_from_distributed_body(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], weight_version: str | None,
    group_name: str = "weight_update_group", *, flush_cache: bool = True, load_format: str | None = None,
) -> dict[str, Any]:
    """Announce one broadcast: the trainer then broadcasts these tensors over the group -- each one on its
    own, in this order, or with load_format "flattened_bucket" all of them as one flat uint8 buffer, their
    bytes back to back (sglang/srt/weight_sync/tensor_bucket.py). weight_version None keeps the served
    version's label (a bucket before the last); flush_cache drops the radix cache the old weights filled."""
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names/dtypes/shapes: need equal non-zero lengths, got {len(names)}/{len(dtypes)}/{len(shapes)}")
    if load_format not in (None, "flattened_bucket"):
        raise ValueError(f"load_format: None or 'flattened_bucket', got {load_format!r}")
    body: dict[str, Any] = {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(s) for s in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version,
    }
    if load_format is not None:
        body["load_format"] = load_format
    return body


def weights_checksum_body() -> dict[str, Any]:
    """/weights_checker: SGLang's hash of every parameter it serves (CheckWeightsReqInput)."""
    return {"action": "checksum"}


def update_weight_version_body(new_version: str) -> dict[str, Any]:
    if not new_version:
        raise ValueError("new_version: must be non-empty")
    # Calls are serialized: nothing of ours is in flight to abort.
    return {"new_version": new_version, "abort_all_requests": False}


def load_lora_adapter_body(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    if not lora_name or not lora_path:
        raise ValueError("lora_name/lora_path: must be non-empty")
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}


# ------------------------------------------------------------------ client --

class SGLangClient:
    """Thin synchronous client; every call raises SGLangConnectionError or SGLangRequestError."""

    def __init__(self, base_url: str, *, timeout_s: float, api_key: str, control_timeout_s: float = 60.0):
        self.base_url = base_url.rstrip("/")
        # SGLang's --api-key guards every endpoint but /health*, /ready* and /metrics*, as a bearer token.
        self._http = httpx.Client(base_url=self.base_url, timeout=control_timeout_s, trust_env=False,
                                  headers={"Authorization": f"Bearer {api_key}"})
        self._generate_timeout = timeout_s

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> httpx.Response:
        try:
            kwargs: dict[str, Any] = {"json": json} if json is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            resp = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:  # connect/read errors, timeouts, resets
            raise SGLangConnectionError(f"sglang {path}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 400:
            raise SGLangRequestError(path, resp.status_code, resp.text)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._call(method, path, **kw)
        try:
            return resp.json()
        except ValueError:
            raise SGLangRequestError(path, resp.status_code, f"not JSON: {resp.text[:500]}") from None

    def _checked(self, path: str, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """POST a control request whose answer carries {"success": bool, "message": str}."""
        out = self._json("POST", path, json=body, timeout=timeout)
        if not out.get("success", False):
            raise SGLangRequestError(path, 200, str(out.get("message") or out.get("error_message") or out))
        return out

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            return self._http.get("/health", timeout=timeout).status_code == 200
        except httpx.TransportError:
            return False

    def generate(self, body: dict[str, Any]) -> Any:
        return self._json("POST", "/generate", json=body, timeout=self._generate_timeout)

    def model_info(self) -> dict[str, Any]:
        return self._json("GET", "/model_info")

    def weight_version(self) -> str | None:
        return self.model_info().get("weight_version")

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")

    def pause_generation(self, mode: Literal["abort", "retract", "in_place"] = "retract") -> None:
        self._call("POST", "/pause_generation", json={"mode": mode})

    def continue_generation(self) -> None:
        self._call("POST", "/continue_generation", json={})

    def update_weights_from_disk(self, model_path: str, weight_version: str, timeout: float) -> dict[str, Any]:
        return self._checked("/update_weights_from_disk", update_weights_from_disk_body(model_path, weight_version), timeout)

    def init_weights_update_group(self, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """Returns once every rank joined: the trainer hosts the group meanwhile."""
        return self._checked("/init_weights_update_group", init_weights_update_group_body(**kw), timeout)

    def update_weights_from_distributed(self, timeout: float | None = None, **kw: Any) -> dict[str, Any]:
        """Returns once the announced tensors arrived and were loaded."""
        return self._checked("/update_weights_from_distributed", update_weights_from_distributed_body(**kw), timeout)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return self._checked("/destroy_weights_update_group", {"group_name": group_name})

    def begin_weight_update(self) -> dict[str, Any]:
        """Open the weight-update session /update_weights_from_distributed runs in (BeginWeightUpdateReqInput)."""
        return self._checked("/begin_weight_update", {})

    def end_weight_update(self) -> dict[str, Any]:
        return self._checked("/end_weight_update", {})

    def weights_checksum(self) -> str:
        """SGLang's checksum over every parameter the server holds (per_engine_checksum of /weights_checker)."""
        out = self._checked("/weights_checker", weights_checksum_body())
        checksum = out.get("per_engine_checksum")
        if not isinstance(checksum, str) or not checksum:
            raise SGLangRequestError("/weights_checker", 200, f"no per_engine_checksum in {str(out)[:500]}")
        return checksum

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
        return self._checked("/load_lora_adapter", load_lora_adapter_body(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self._checked("/unload_lora_adapter", {"lora_name": lora_name})

    def update_weight_version(self, new_version: str) -> dict[str, Any]:
        """Relabel the served weights (a LoRA version changes the adapter, not the base)."""
        return self._checked("/update_weight_version", update_weight_version_body(new_version))
