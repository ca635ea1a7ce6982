"""The embedded PyTorch rollout engine: the stock Hugging Face model driven by services.rollout.embedded.decoder.

It runs the trainer's model code (services.common.models.loading.load_causal_lm, the
stock Hugging Face module) and scores every sampled token with the trainer's
log-prob definition (kernels.logprob.token_logprobs), so that before the first
update rollout and trainer agree on every response token. Generation (continuous
batching over a paged KV pool, chunked and shared prefill, preemption, CUDA
graphs, numerics modes) lives in the decoder; this module loads, validates
requests and applies weight updates.

Reported log-prob of a sampled token = log_softmax(logits / T)[token] over the
FULL vocabulary (T = 1 in greedy mode). Top-k / top-p truncate the
distribution the token is drawn from but are not part of the scored
distribution, the same convention as SGLang and vLLM; the trainer recomputes
exactly this quantity, so with top_k/top_p active the importance weight is
still 1 at step 1.

Sampling randomness is per sample: sample i of a prompt draws from the
counter-based stream of seed `prompt.seed + i` (kernels.sampling), so
a sample's tokens do not depend on which other prompts share its batch.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator

import torch

from contract.engine_options import TorchEngineConfig
from services.common.models.loading import load_causal_lm
from services.common.records.fingerprint import probe_platform_details
from services.common.weights.finite_check import FiniteTensors, non_finite
from services.common.weights.stream import LoraAdapterMeta
from services.rollout.config import RolloutServiceConfig
from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.embedded.scheduler import pages_for
from services.rollout.engine import Engine, require_device
from services.rollout.episodes.runner import SampledTurn
from services.rollout.types import (
    GeneratedSample, GenerationRequest, PrefillCounts, SamplingConfig, check_request_fits_model,
)
from services.rollout.weights.lora_adapter import merged_weight, module_adapters

__all__ = ["TorchEngine", "TorchEngineConfig", "decoder_options"]


def decoder_options(config: TorchEngineConfig) -> DecoderOptions:
    """The decoder's options for an engine configuration."""
    return DecoderOptions(
        numerics=config.numerics,
        max_batch_size=config.max_batch_size,
        cuda_graphs=config.graphs_enabled,
        max_context_tokens=config.max_context_tokens,
        pad_token_id=config.pad_token_id,
        logprob_backend=config.logprob_backend,
        kv_pool_tokens=config.kv_cache_tokens,
        kv_pool_memory_fraction=config.kv_cache_memory_fraction,
        prefill_chunk_tokens=config.prefill_chunk_tokens,
    )


class TorchEngine(Engine):
    """One Hugging Face causal LM in this process; calls are serialised by the server."""

    name = "torch"
    supports_resume = True
    supports_episodes = True

    def __init__(self, config: TorchEngineConfig | None = None) -> None:
        self.config = config or TorchEngineConfig()
        self._device = torch.device(self.config.device)
        self._model: torch.nn.Module | None = None
        self._model_path = ""
        self._policy_version = -1
        self._decoder: Decoder | None = None
        # LoRA: the loaded base weight of every module an adapter has changed (each version is merged
        # into these, never into the previous merge), and a digest of the adapter at the current version.
        self._pristine: dict[str, torch.Tensor] = {}
        self._adapter_digest: str | None = None
        # Pause: set by request_pause (the server's thread), read by the decoder at each token boundary.
        self._pause = threading.Event()
        self._generating = threading.Event()

    @classmethod
    def from_config_json(cls, text: str, service: RolloutServiceConfig | None = None) -> "TorchEngine":
        """Registry entry point: build from LoadModelRequest.engine_config_json (ValueError names the field).
        Nothing of the service's configuration concerns this engine."""
        return cls(TorchEngineConfig.from_json(text))

    # ------------------------------------------------------------ lifecycle --

    def load(self, model_path: str, policy_version: int) -> None:
        require_device(self.config.device)
        model = load_causal_lm(
            model_path,
            dtype=self.config.dtype,
            device=self.config.device,
            attn_implementation=self.config.attn_implementation,
        )
        model.eval()
        model.requires_grad_(False)
        vocab = model.get_input_embeddings().num_embeddings
        if self.config.pad_token_id >= vocab:
            raise ValueError(f"engine_config.pad_token_id: {self.config.pad_token_id} outside the vocabulary [0, {vocab})")
        self._probe_logprob_backend(model, vocab)
        try:
            decoder = Decoder(model, decoder_options(self.config))  # true_on_policy patches the model here
        except ValueError as exc:  # DecoderUnsupported, BatchInvariantUnsupported: the model, not the call
            field = "numerics" if self.config.numerics == "true_on_policy" else "model"
            raise ValueError(f"engine_config.{field}: the {self.config.numerics!r} decoder cannot run this "
                             f"model: {exc}") from exc
        self._model, self._decoder, self._model_path = model, decoder, str(model_path)
        self._pristine, self._adapter_digest = {}, None
        self._policy_version = int(policy_version)

    def _probe_logprob_backend(self, model: torch.nn.Module, vocab: int) -> None:
        """Score one dummy token now, so a backend that cannot serve this dtype/device fails LoadModel, not step 1."""
        from kernels.logprob import token_logprobs

        dtype = next(model.parameters()).dtype
        logits = torch.zeros((1, vocab), dtype=dtype, device=self._device)
        try:
            token_logprobs(logits, torch.zeros(1, dtype=torch.long, device=self._device),
                           backend=self.config.logprob_backend)
        except Exception as exc:  # noqa: BLE001 - re-raised naming the option that chose the backend
            raise ValueError(f"engine_config.logprob_backend: {self.config.logprob_backend!r} cannot serve "
                             f"{dtype} on {self._device}: {exc}") from exc

    def close(self) -> None:
        self._model, self._decoder = None, None

    def broadcast_device(self) -> torch.device:
        return self._device

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def model_path(self) -> str:
        return self._model_path

    def info(self) -> dict[str, str]:
        import transformers

        return {
            "engine": self.name,
            "device": str(self._device),
            "dtype": self.config.dtype,
            "attn_implementation": self.config.attn_implementation,
            "max_batch_size": str(self.config.max_batch_size),
            "numerics": self.config.numerics,
            "cuda_graphs": str(self.config.graphs_enabled).lower(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "logprob_backend": self.config.logprob_backend,
            **probe_platform_details(str(self._device)),
            "prefill_attention": self._decoder.prefill_attention if self._decoder is not None else "",
            "decode_attention": self._decoder.decode_attention if self._decoder is not None else "",
            "decode_forward": self._decoder.decode_forward if self._decoder is not None else "",
        }

    def _require_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("torch engine: no model loaded (call load first)")
        return self._model

    # ------------------------------------------------------------- generate --

    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        self.validate_request(request)
        assert self._decoder is not None  # set with the model by load
        # Sequence s = (prompt, sample index); output order is prompt order, then index.
        seqs = request.sequences()
        resumed = {r.sample_id: r for r in request.resumed}
        prefixes = [(resumed[k].token_ids, resumed[k].logprobs) if (k := f"{p.group_id}/{i}") in resumed else None
                    for p, i in seqs]
        self._pause.clear()
        self._generating.set()
        try:
            decoded = self._decoder.decode([p.token_ids for p, _ in seqs], [p.seed + i for p, i in seqs],
                                           request.sampling, prefixes=prefixes, should_pause=self._pause.is_set)
        finally:
            self._generating.clear()
            self._pause.clear()
        out = []
        for (p, i), d in zip(seqs, decoded):
            earlier = resumed.get(f"{p.group_id}/{i}")
            before = list(earlier.policy_versions) if earlier else []
            out.append(GeneratedSample(group_id=p.group_id, index=i, token_ids=d.token_ids, logprobs=d.logprobs,
                                       finish_reason=d.finish_reason,
                                       policy_versions=before + [self._policy_version] * (len(d.token_ids)
                                                                                           - len(before)),
                                       routed_experts=d.routed_experts))
        return out

    def max_sequence_tokens(self) -> int | None:
        return None if self._decoder is None else self._decoder.max_sequence_tokens

    def sample_turns(self, contexts: list[list[int]], seeds: list[int], sampling: SamplingConfig,
                     episode_ids: list[str] | None = None) -> list[SampledTurn]:
        """One model turn of each multi-turn episode (services/rollout/episodes/runner.py): each context's
        continuation from its seed's stream, tokens and log-probs as sampled. With `episode_kv_reuse`, each
        episode's K/V is kept under its id after the turn and reused by its next turn (its next context
        extends this one), until `episodes_ended`."""
        self._require_model()
        assert self._decoder is not None
        keys = episode_ids if self.config.episode_kv_reuse else None
        decoded = self._decoder.decode(contexts, seeds, sampling, keys=keys)
        return [SampledTurn(d.token_ids, d.logprobs, d.finish_reason) for d in decoded]

    def episodes_ended(self, episode_ids: list[str]) -> None:
        if self._decoder is not None:
            self._decoder.forget(episode_ids)

    def take_prefill_counts(self) -> PrefillCounts | None:
        return None if self._decoder is None else self._decoder.take_counters()

    def request_pause(self) -> bool:
        if not self._generating.is_set():
            return False
        self._pause.set()
        return True

    def validate_request(self, request: GenerationRequest) -> None:
        """Checks that need the model (vocabulary, context length); ValueError names the field."""
        model = self._require_model()
        vocab = model.get_input_embeddings().num_embeddings
        check_request_fits_model(request, vocab=vocab, max_len=getattr(model.config, "max_position_embeddings", None))
        for i, p in enumerate(request.prompts):
            cap = self.config.max_context_tokens
            if cap is not None and len(p.token_ids) + request.sampling.max_new_tokens > cap:
                raise ValueError(
                    f"sampling.max_new_tokens: prompts[{i}] has {len(p.token_ids)} tokens; plus "
                    f"{request.sampling.max_new_tokens} new tokens exceeds engine_config.max_context_tokens={cap}"
                )
            pool = self.config.kv_cache_tokens
            if pool is not None and pages_for(len(p.token_ids) + request.sampling.max_new_tokens) > pages_for(pool):
                raise ValueError(
                    f"sampling.max_new_tokens: prompts[{i}] has {len(p.token_ids)} tokens; plus "
                    f"{request.sampling.max_new_tokens} new tokens exceeds engine_config.kv_cache_tokens={pool}"
                )
        bad_stop = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"sampling.stop_token_ids: id {bad_stop[0]} outside the vocabulary [0, {vocab})")

    # ------------------------------------------------------- update weights --

    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int, *,
                       finite_checked: bool = False) -> None:
        """Verify every tensor against the model, then copy all in; nothing is applied on any error.

        Every model tensor must be sent (a weight left out would silently keep
        the old policy under the new version). Tied aliases (e.g. lm_head /
        embed_tokens) count as one tensor and may be sent under either name.
        Re-sending the loaded version with identical weights is a no-op;
        different weights under the loaded version are refused.
        """
        with one_intra_op_thread(self._device):
            self._checked_update(tensors, policy_version, check_finite=not finite_checked)

    def update_weights_from_dir(self, directory: str, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """As update_weights. Tensors read_weight_dir returned as FiniteTensors had every floating value found
        finite as they were read, so that pass is not repeated; any other mapping is checked here."""
        self.update_weights(tensors, policy_version, finite_checked=isinstance(tensors, FiniteTensors))

    def _checked_update(self, tensors: dict[str, torch.Tensor], policy_version: int, *, check_finite: bool) -> None:
        model = self._require_model()
        targets = model.state_dict(keep_vars=True)
        problems: list[str] = []
        fitting: dict[str, torch.Tensor] = {}  # of the model's names, shapes and dtypes: checked for finiteness
        for name, t in tensors.items():
            dst = targets.get(name)
            if dst is None:
                problems.append(f"{name}: not a tensor of the loaded model")
            elif tuple(t.shape) != tuple(dst.shape):
                problems.append(f"{name}: shape {tuple(t.shape)} != model's {tuple(dst.shape)}")
            elif t.dtype != dst.dtype:
                problems.append(f"{name}: dtype {t.dtype} != model's {dst.dtype}")
            else:
                fitting[name] = t
        if check_finite:
            problems.extend(f"{name}: non-finite values" for name in non_finite(fitting))
        # Group names by storage so tied aliases are one required tensor.
        groups: dict[int, list[str]] = {}
        for name, dst in targets.items():
            groups.setdefault(id(dst), []).append(name)
        for names in groups.values():
            sent = [n for n in names if n in tensors]
            if not sent:
                problems.append(f"{names[0]}: missing from the update")
            elif len(sent) > 1 and not problems and not all(torch.equal(tensors[sent[0]], tensors[n]) for n in sent[1:]):
                problems.append(f"{', '.join(sent)}: tied in the model but sent with different values")
        if problems:
            more = f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError("weights: " + "; ".join(problems[:8]) + more)

        with torch.no_grad():
            if policy_version == self._policy_version:
                if all(torch.equal(targets[n].detach(), t.to(targets[n].device)) for n, t in tensors.items()):
                    return
                raise ValueError(
                    f"policy_version: {policy_version} is already loaded with different weights; "
                    "a new policy needs a new version"
                )
            for name, t in tensors.items():  # from pinned host memory these copies overlap
                targets[name].detach().copy_(t, non_blocking=True)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)  # done before the caller reuses the tensors' memory
        # A whole set of weights is a new base: no adapter is merged into it.
        self._pristine, self._adapter_digest = {}, None
        self._policy_version = int(policy_version)
        self._weights_changed()

    def update_lora_adapter(self, meta: LoraAdapterMeta, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """Merge the adapter into the loaded base: W = W0 + (alpha / rank) * B @ A in float32 from the base as
        loaded, cast to the engine's dtype. Modules an earlier adapter changed and this one does not go back to
        their base. Everything is checked before the first weight changes; re-sending the loaded version's
        adapter is a no-op, another adapter under the loaded version is refused."""
        model = self._require_model()
        adapters = module_adapters(tensors, meta)
        modules = dict(model.named_modules())
        problems = []
        for name, adapter in adapters.items():
            module = modules.get(name)
            if not isinstance(module, torch.nn.Linear):
                problems.append(f"{name}: not a linear layer of the loaded model")
            elif (adapter.b.shape[0], adapter.a.shape[1]) != tuple(module.weight.shape):
                problems.append(f"{name}: adapter B @ A is {adapter.b.shape[0]} x {adapter.a.shape[1]}, "
                                f"the layer's weight {tuple(module.weight.shape)}")
        if problems:
            raise ValueError("weights: " + "; ".join(problems[:8]))
        digest = _adapter_digest(meta, tensors)
        if policy_version == self._policy_version:
            if digest == self._adapter_digest:
                return
            raise ValueError(f"policy_version: {policy_version} is already loaded with different weights; "
                             "a new policy needs a new version")
        with torch.no_grad():
            for name in adapters:
                self._pristine.setdefault(name, modules[name].weight.detach().clone())
            for name, base in self._pristine.items():
                weight = modules[name].weight.detach()
                weight.copy_(merged_weight(base, adapters[name], meta.scale) if name in adapters else base)
        self._policy_version, self._adapter_digest = int(policy_version), digest
        self._weights_changed()

    def _weights_changed(self) -> None:
        """K/V kept for episodes was computed with the old weights: the next turn re-prefills."""
        if self._decoder is not None:
            self._decoder.weights_changed()


def _adapter_digest(meta: LoraAdapterMeta, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(repr((meta.rank, meta.alpha, sorted(meta.target_modules))).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def one_intra_op_thread(device: torch.device | str) -> Iterator[None]:
    """On CPU, torch ops in the block run on one intra-op thread. Checking and copying a model's tensors is
    memory-bound: one thread moves them about as fast as several, while a fork-join per tensor across
    threads waits on whichever thread the OS has not scheduled (on a host whose cores are shared, most of
    the time: 0.5 GB/s against 3.5 GB/s for 2 MB copies on two busy cores)."""
    if torch.device(device).type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
