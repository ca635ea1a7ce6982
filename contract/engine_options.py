"""The engine options a run spec may set (`rollout.engine_options`): pydantic only, no torch.

The rollout service validates LoadModel's `engine_config_json` with these
models, and the coordinator validates a run spec's engine_options with the
same ones at submit time, so both refuse a bad option with the same message.
What the rollout host's operator decides (the SGLang interpreter, weight and
log directories, server URL, where the server listens, extra flags) is not
here: it is the rollout service's configuration (services/rollout/config.py,
sglang/config.py). Options that reach the SGLang server's command line declare
their flag and keep a grammar none of whose values reads as an option
(contract/command_line.py).
"""
from __future__ import annotations

import json
import re
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.command_line import server_flag, server_switch
from contract.platforms import SGLangPlatformConfig

LOGPROB_BACKEND_NAMES: tuple[str, ...] = ("reference", "triton", "native")
"""kernels.logprob backends a run may name (besides 'auto')."""

# Device types torch.device parses (c10's DeviceType names): a string of one
# of these, optionally ':<index>', is a torch device name.
TORCH_DEVICE_TYPES = frozenset({
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga", "maia", "xla",
    "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
})
_DEVICE_NAME = re.compile(r"(?P<type>[a-z_]+)(?::(?P<index>[0-9]+))?")


def torch_device_type(name: str) -> str:
    """The device type of torch device name `name` ('cuda' for 'cuda:1'), parsed as torch.device parses it;
    ValueError saying why for a string torch.device refuses."""
    match = _DEVICE_NAME.fullmatch(name)
    if match is None or match["type"] not in TORCH_DEVICE_TYPES:
        raise ValueError(f"not a torch device name (expected a device type such as 'cpu' or 'cuda', "
                         f"optionally followed by ':<index>'; got {name!r})")
    return match["type"]


ConfigT = TypeVar("ConfigT", bound=BaseModel)


class EngineConfigError(ValueError):
    """Refused engine options; `fields` is [(option, reason)], the option dotted within the options
    (`server.dtype`; '' for the options as a whole). The message names each as `engine_config.<option>`."""

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self.fields = fields
        super().__init__("; ".join(f"engine_config{'.' + f if f else ''}: {reason}" for f, reason in fields))


def parse_engine_config(model: type[ConfigT], text: str) -> ConfigT:
    """Parse LoadModelRequest.engine_config_json into an engine's own config.

    Errors are EngineConfigError (a ValueError) naming the field
    (`engine_config.dtype: ...`), which the server answers with INVALID_ARGUMENT.
    """
    try:
        raw = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"engine_config_json: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"engine_config_json: expected a JSON object, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        fields = []
        for err in exc.errors():
            if err["type"] == SERVICE_OWNED_ERROR:  # raised above the option it names
                fields.append((err["ctx"]["option"], err["ctx"]["reason"]))
                continue
            fields.append((".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")))
        raise EngineConfigError(fields) from None


class TorchEngineConfig(BaseModel):
    """Options of the embedded torch engine (LoadModelRequest.engine_config_json)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights and activations dtype; must equal the trainer's or step-1 importance weights drift.",
    )
    device: str = Field("cpu", min_length=1, description="torch device the model runs on ('cpu', 'cuda', 'cuda:1').")
    max_batch_size: int = Field(
        64,
        ge=1,
        le=65536,
        description="Most sequences (prompts x samples) decoded together; the rest wait and are admitted as rows "
        "and KV pages free up (continuous batching).",
    )
    attn_implementation: str = Field(
        "sdpa",
        min_length=1,
        description="Hugging Face attention implementation the model is loaded with (and runs with outside "
        "generation). Generation runs the decoder's own attention: packed prefill, then decode_attention over "
        "a static KV cache.",
    )
    numerics: Literal["fast", "true_on_policy"] = Field(
        "fast",
        description="'fast': the model's own kernels. 'true_on_policy': batch-invariant kernels for every op from "
        "token ids to log-probs (float32 or bfloat16 only), so each reported log-prob has the bits of the "
        "trainer's recompute in the same mode; must equal the trainer's numerics.",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="Capture each decode step as a CUDA graph (per batch-size bucket: powers of two up to "
        "max_batch_size). None = on for CUDA devices, off on CPU; true on a CPU device is refused.",
    )
    max_context_tokens: int | None = Field(
        None,
        ge=1,
        le=1 << 20,
        description="KV-cache capacity per sequence (prompt + new tokens), allocated once; a longer request is "
        "refused. None sizes the cache from each batch (grown in steps of 256 tokens, never shrunk).",
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=64,
        le=1 << 28,
        description="Size of the paged KV pool in tokens (rounded up to pages of 64), allocated once. A request "
        "whose longest sequence (prompt + max_new_tokens) exceeds it is refused; when sequences outgrow it the "
        "latest admitted is preempted and recomputed later. None (and no memory fraction): the pool grows to "
        "max_batch_size x the request's longest sequence.",
    )
    kv_cache_memory_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Size of the paged KV pool as this fraction of the device memory free when it is first "
        "allocated (after the model is loaded); CUDA only; exclusive with kv_cache_tokens.",
    )
    prefill_chunk_tokens: int = Field(
        8192,
        ge=1,
        le=1 << 20,
        description="Most prompt tokens prefilled in one forward; longer prompts, and prompts arriving while others "
        "decode, are prefilled in chunks between decode steps.",
    )
    episode_kv_reuse: bool = Field(
        True,
        description="Multi-turn episodes: keep an episode's KV pages from one turn to the next and prefill only "
        "the new suffix (the last sampled token and the observation). False re-prefills the whole context every "
        "turn (the baseline; in true_on_policy both give the same bits).",
    )
    logprob_backend: str = Field(
        "auto",
        min_length=1,
        description="kernels.logprob backend ('auto', 'reference', 'triton', 'native'); must match the trainer's.",
    )
    pad_token_id: int = Field(
        0,
        ge=0,
        description="Id placed in left padding and after a sequence finished. Those positions are masked out of "
        "attention, so any in-vocabulary id gives the same results.",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        device_type = torch_device_type(v)
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"{v!r}: only 'cpu' and 'cuda[:N]' devices serve rollouts")
        return v

    @field_validator("cuda_graphs")
    @classmethod
    def _graphs_need_cuda(cls, v: bool | None, info: ValidationInfo) -> bool | None:
        device = info.data.get("device")
        if v and device is not None and torch_device_type(device) != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, device is {device!r}")
        return v

    @field_validator("numerics")
    @classmethod
    def _mode_dtype(cls, v: str, info: ValidationInfo) -> str:
        if v == "true_on_policy" and info.data.get("dtype") == "float16":
            raise ValueError("'true_on_policy' has no batch-invariant kernels for dtype 'float16' "
                             "(use 'float32' or 'bfloat16')")
        return v

    @property
    def graphs_enabled(self) -> bool:
        """Whether decode steps are captured: cuda_graphs, or by default whether the device is CUDA."""
        return torch_device_type(self.device) == "cuda" if self.cuda_graphs is None else self.cuda_graphs

    @field_validator("kv_cache_memory_fraction")
    @classmethod
    def _fraction_needs_cuda(cls, v: float | None, info: ValidationInfo) -> float | None:
        device = info.data.get("device")
        if v is not None and device is not None and torch_device_type(device) != "cuda":
            raise ValueError(f"sizes the KV pool from CUDA memory, device is {device!r} (set kv_cache_tokens)")
        if v is not None and info.data.get("kv_cache_tokens") is not None:
            raise ValueError("set either kv_cache_tokens or kv_cache_memory_fraction, not both")
        return v

    @field_validator("logprob_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        if v != "auto" and v not in LOGPROB_BACKEND_NAMES:
            raise ValueError(f"unknown backend {v!r}; known: {['auto', *LOGPROB_BACKEND_NAMES]}")
        return v

    @classmethod
    def from_json(cls, text: str) -> "TorchEngineConfig":
        """Parse and validate; errors are ValueError naming the field (`engine_config.dtype: ...`)."""
        return parse_engine_config(cls, text)


SERVICE_OWNED_OPTIONS: dict[str, str] = {
    "python": "sglang_python",
    "weights_dir": "sglang_weights_dir",
    "log_dir": "sglang_weights_dir",
    "url": "sglang_url",
    "extra_args": "sglang_extra_args",
    "host": "sglang_host",
    "port": "sglang_port",
}
"""Options a run may not set (they choose an executable, a server to talk to, where files are written or
where a server listens), with the rollout service setting that decides each instead."""
LISTEN_OPTIONS = frozenset({"host", "port"})
SERVICE_OWNED_ERROR = "service_owned_option"


def service_owned_reason(option: str) -> str:
    """Why a run may not set `option` (one of SERVICE_OWNED_OPTIONS), without the option's name."""
    what = ("where a server listens is the operator's choice" if option in LISTEN_OPTIONS
            else "it chooses what runs on the host or where files are written")
    return f"set by the rollout service's configuration ({SERVICE_OWNED_OPTIONS[option]}), not by a run: {what}"


SGLangMoeRunner = Literal["auto", "triton", "triton_kernel", "deep_gemm", "cutlass", "flashinfer_cutlass",
                          "flashinfer_trtllm", "aiter"]
"""SGLang's --moe-runner-backend values a run may pick (its MOE_RUNNER_BACKEND_CHOICES for bf16 models)."""
SGLangMoeAllToAll = Literal["none", "deepep", "mooncake", "mori"]
"""SGLang's --moe-a2a-backend values a run may pick."""


class SGLangEngineConfig(BaseModel):
    """How a run wants its SGLang server: platform, parallelism, timeouts (see SGLangHostConfig for the rest)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    platform: str = Field(
        "auto",
        description="'auto' (detect: services.common.platform.probe_platform), 'cpu', 'cuda' or 'rocm'.",
    )
    server: SGLangPlatformConfig = Field(
        default_factory=SGLangPlatformConfig,
        description="Platform-dependent server options (attention backend on CUDA, deterministic mode, dtype, ...).",
    )
    tp_size: int = Field(1, ge=1, le=1024, json_schema_extra=server_flag("--tp-size"),
                         description="Tensor-parallel degree of the server (--tp-size).")
    # Mixture-of-experts serving (SGLang's own flags; None leaves the server's default and passes nothing).
    ep_size: int | None = Field(None, ge=1, le=1024, json_schema_extra=server_flag("--ep-size"),
                                description="Expert-parallel degree of the MoE layers (--ep-size); divides tp_size.")
    moe_runner_backend: SGLangMoeRunner | None = Field(
        None, json_schema_extra=server_flag("--moe-runner-backend"),
        description="Kernel family of the MoE layers (--moe-runner-backend): 'triton' is the portable one "
                    "(CUDA and ROCm), 'aiter' ROCm's, 'deep_gemm'/'cutlass'/'flashinfer_*' NVIDIA's.")
    moe_a2a_backend: SGLangMoeAllToAll | None = Field(
        None, json_schema_extra=server_flag("--moe-a2a-backend"),
        description="All-to-all of expert parallelism across GPUs (--moe-a2a-backend); needs ep_size > 1.")
    return_routed_experts: bool = Field(
        False, json_schema_extra=server_switch("--enable-return-routed-experts"),
        description="MoE routing replay: start the server with --enable-return-routed-experts and return every "
                    "token's experts with its sample (what trainer.moe.routing_replay needs). The server's "
                    "capture buffer is CUDA/ROCm host memory: its CPU build cannot start with it.")
    keep_versions: int = Field(
        2, ge=1, description="Synced checkpoints kept on disk (the current one always among them)."
    )
    startup_timeout_s: float = Field(
        300.0, gt=0, description="Seconds a launched server gets to answer /health (CPU start-up is 20-90 s)."
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Seconds one /generate call may take before the server is considered lost."
    )
    weight_update_timeout_s: float = Field(600.0, gt=0, description="Seconds /update_weights_from_disk may take.")
    max_restarts: int = Field(
        3, ge=0, description="Consecutive failed restarts after which the engine stops trying and stays unavailable."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_service_options(cls, data: object) -> object:
        if isinstance(data, dict):
            for key in sorted(set(data) & set(SERVICE_OWNED_OPTIONS)):
                raise PydanticCustomError(SERVICE_OWNED_ERROR, "{option}: {reason}",
                                          {"option": key, "reason": service_owned_reason(key)})
        return data

    @model_validator(mode="after")
    def _expert_parallel_fits(self) -> "SGLangEngineConfig":
        if self.ep_size is not None and self.tp_size % self.ep_size:
            raise ValueError(f"ep_size: {self.ep_size} does not divide tp_size {self.tp_size} (SGLang places the "
                             "expert-parallel group inside the tensor-parallel one)")
        if self.moe_a2a_backend not in (None, "none") and (self.ep_size or 1) == 1:
            raise ValueError(f"moe_a2a_backend: {self.moe_a2a_backend!r} moves tokens between expert-parallel ranks; "
                             "set ep_size > 1")
        return self

    @field_validator("platform")
    @classmethod
    def _known_platform(cls, v: str) -> str:
        if v not in ("auto", "cpu", "cuda", "rocm"):
            raise ValueError(f"unknown platform {v!r}; expected auto, cpu, cuda or rocm")
        return v

    @classmethod
    def from_json(cls, text: str) -> "SGLangEngineConfig":
        """Parse and validate; errors are ValueError naming the field (`engine_config.server.dtype: ...`)."""
        return parse_engine_config(cls, text)


class RewardModelEngineConfig(BaseModel):
    """Options of the reward-model engine a scorer replica runs (docs/rewards.md): a Hugging Face
    AutoModelForSequenceClassification with one scalar head, scoring (prompt, response) through its chat template."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and activations dtype (bfloat16 on GPUs; scores are read in float32).")
    device: str = Field("cpu", min_length=1, description="torch device the model runs on ('cpu', 'cuda', 'cuda:1').")
    max_batch_size: int = Field(
        32, ge=1, le=65536, description="Most (prompt, response) pairs scored in one forward; a Score call with "
        "more runs several, in order.")

    @classmethod
    def from_json(cls, text: str) -> "RewardModelEngineConfig":
        return parse_engine_config(cls, text)


SGLANG_REWARD_MODEL_REFUSAL = (
    "SGLang cannot serve this project's reward models: its Qwen2ForSequenceClassification and "
    "Qwen3ForSequenceClassification (0.5.23) give the one-label head a bias that a Hugging Face checkpoint does "
    "not have and leave it at its random initialization, so every score would be off by a constant that is not "
    "in the model's files (docs/rewards.md); use engine 'reward_model'")
"""Why a reward model is not served by engine 'sglang': refused at submit (reward.reward_model.engine) and by a
scorer replica asked to load a sequence classifier on SGLang."""


ENGINE_OPTIONS: dict[str, type[BaseModel]] = {
    "torch": TorchEngineConfig,
    "sglang": SGLangEngineConfig,
    "reward_model": RewardModelEngineConfig,
}
"""Each rollout engine's options model, by engine name (the rollout service's engine registry has the same names)."""


def known_engines() -> list[str]:
    return sorted(ENGINE_OPTIONS)


def engine_config_class(name: str) -> type[BaseModel]:
    """The options model of engine `name`; ValueError listing the known engines otherwise."""
    model = ENGINE_OPTIONS.get(name)
    if model is None:
        raise ValueError(f"engine: unknown engine {name!r}; known engines: {known_engines()}")
    return model


def check_engine_options(name: str, options_json: str) -> BaseModel:
    """Validate engine options as LoadModel will; EngineConfigError naming each bad field
    (`engine_config.dtype: ...`), ValueError for an unknown engine."""
    return parse_engine_config(engine_config_class(name), options_json)
