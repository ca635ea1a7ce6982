"""The rollout engine interface. The gRPC servicer talks only to this.

Engines: `torch` (embedded, services/rollout/embedded/torch_engine.py, the default that
runs anywhere) and `sglang` (services/rollout/sglang/engine.py). A run selects
one by name in its spec; an unknown or unavailable engine is an error, never a
fallback to another engine.
"""
from __future__ import annotations

import abc
import torch

from services.common.weights.stream import LoraAdapterMeta
from services.rollout.config import RolloutServiceConfig
from services.rollout.episodes.requests import EpisodeRequest
from services.rollout.episodes.runner import Episode, ObservationCodec, SampledTurn, episode_codec, run_episodes
from services.rollout.types import GeneratedSample, GenerationRequest, PrefillCounts, PromptSpec, SamplingConfig


class DeviceUnavailable(RuntimeError):
    """The device an engine's options name does not exist on this host (`cuda:99`, CUDA on a CPU host)."""


def require_device(name: str) -> torch.device:
    """`name` as a torch.device present on this host; DeviceUnavailable naming it otherwise."""
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise DeviceUnavailable(f"engine_config.device: {name!r} is not on this host ({count} CUDA devices)")
    return device


class EngineUnavailable(RuntimeError):
    """The engine (or its server process) cannot serve right now; the work was lost and may be retried."""


class Engine(abc.ABC):
    """One model, one policy version at a time. Calls are serialized by the server."""

    name: str = "abstract"
    supports_resume: bool = False
    """Whether generate() continues GenerationRequest.resumed samples (and request_pause() works)."""
    supports_episodes: bool = False
    """Runs multi-turn episodes (GenerateRequest.episode) through `run_episodes`."""

    @classmethod
    @abc.abstractmethod
    def from_config_json(cls, text: str, service: RolloutServiceConfig | None = None) -> "Engine":
        """Build from LoadModelRequest.engine_config_json; ValueError naming the field on bad options.

        `service` is the rollout service's own configuration: what the operator decides (interpreters,
        directories, servers to reach) comes from there, never from the run's options."""

    @abc.abstractmethod
    def load(self, model_path: str, policy_version: int) -> None: ...

    def reload(self, config_json: str, model_path: str, policy_version: int) -> bool:
        """Serve a new run's model with what this engine already runs, when the run's options and the model's
        files other than its weights are the same as the loaded ones: True once it serves `model_path` at
        `policy_version`; False, with nothing changed, when it cannot (then the caller builds and loads a
        new engine). By default an engine never can."""
        return False

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        """Samples in prompt order, then sample index order."""

    @abc.abstractmethod
    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int, *,
                       finite_checked: bool = False) -> None:
        """Replace weights atomically: all tensors verified against the model first, then applied.

        `finite_checked`: the receiver has already found every floating tensor finite (the stream
        assembler checks as chunks arrive), so the engine may skip that pass. The engine keeps no
        reference to `tensors` once this returns: the caller reuses their memory."""

    def update_weights_from_dir(self, directory: str, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """Apply a weight directory the trainer wrote, whose digest has been verified over `tensors` (read from
        it). Applied as update_weights applies them; an engine that loads model directories itself overrides
        this to load `directory` in place rather than write the same tensors out again."""
        self.update_weights(tensors, policy_version)

    def update_lora_adapter(self, meta: LoraAdapterMeta, tensors: dict[str, torch.Tensor],
                            policy_version: int) -> None:
        """Serve the base model with this LoRA adapter from `policy_version` on (replacing any earlier one);
        every tensor verified first, nothing applied on any error. Engines without LoRA support refuse."""
        raise ValueError(f"weights.lora: the {self.name} engine cannot apply LoRA adapters")

    def sample_turns(self, contexts: list[list[int]], seeds: list[int], sampling: SamplingConfig,
                     episode_ids: list[str] | None = None) -> list[SampledTurn]:
        """One model turn of each multi-turn episode: each context's continuation from its seed's stream, as
        one generate() call whose prompts are the contexts (token ids in, token ids out). `episode_ids` name
        the episodes (an engine that keeps an episode's K/V between turns reads them; this one does not)."""
        prompts = tuple(PromptSpec(f"turn{i}", tuple(c), s) for i, (c, s) in enumerate(zip(contexts, seeds)))
        return [SampledTurn(g.token_ids, g.logprobs, g.finish_reason)
                for g in self.generate(GenerationRequest(prompts=prompts, sampling=sampling))]

    def max_sequence_tokens(self) -> int | None:
        """Longest sequence (prompt plus new tokens) the loaded model serves; None: no bound known here."""
        return None

    def episodes_ended(self, episode_ids: list[str]) -> None:
        """These episodes take no more turns: drop anything kept for them (by default nothing is kept)."""

    def take_prefill_counts(self) -> PrefillCounts | None:
        """Prefill work since the last call (the rollout's metrics read it after each request); None: this
        engine does not count it."""
        return None

    def run_episodes(self, request: EpisodeRequest) -> list[Episode]:
        """Every episode of `request` (services/rollout/episodes/runner.py), each turn sampled by `sample_turns`;
        the model directory's tokenizer encodes observations (through its chat template when it has one)
        and decodes turns for the environment."""
        if not self.supports_episodes:
            raise ValueError(f"episode: the {self.name} engine does not run multi-turn episodes")
        longest = self.max_sequence_tokens()
        if longest is not None and request.limits.max_episode_tokens > longest:
            # Refused before any episode starts: a turn past the model's longest sequence would fail the whole
            # request midway, every other episode with it.
            raise ValueError(f"episode.limits_json: max_episode_tokens {request.limits.max_episode_tokens} exceeds "
                             f"the longest sequence the {self.name} engine serves ({longest})")
        try:
            return run_episodes(request.specs, environment=request.environment, options=request.options,
                                limits=request.limits, codec=self._episode_codec(), sample=self.sample_turns,
                                sampling=request.sampling, ended=self.episodes_ended)
        finally:  # whatever ended them (a failure included), none of these episodes takes another turn
            self.episodes_ended([f"{s.group_id}/{s.index}" for s in request.specs])

    def _episode_codec(self) -> ObservationCodec:
        """The codec of the loaded model's tokenizer, read once per model directory."""
        cached = getattr(self, "_codec_cache", None)
        if cached is None or cached[0] != self.model_path:
            cached = (self.model_path, episode_codec(self.model_path))
            self._codec_cache = cached
        return cached[1]

    def request_pause(self) -> bool:
        """Ask the in-flight generate() (another thread) to stop at its next token boundary, returning every
        unfinished sample with finish_reason 'paused'; False if none is in flight. Thread-safe."""
        raise ValueError(f"generation pause: the {self.name} engine cannot pause generation")

    def broadcast_device(self) -> torch.device:
        """Where this engine's model lives, for a replica that receives broadcast weights in this process
        (services/rollout/weights/broadcast_receiver.py) and applies them with update_weights. Engines whose model is
        elsewhere refuse, naming why."""
        raise ValueError(f"rollout.weight_sync: the {self.name} engine cannot receive broadcast weights")

    @property
    @abc.abstractmethod
    def policy_version(self) -> int: ...

    @property
    def model_path(self) -> str:
        return ""

    def info(self) -> dict[str, str]:
        return {"engine": self.name}

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
