"""The embedded PyTorch rollout engine: batched sampling with a KV cache.

It runs the trainer's model code (services.common.models.load_causal_lm, the
stock Hugging Face module) and scores every sampled token with the trainer's
log-prob definition (kernels.logprob.token_logprobs), so that before the first
update rollout and trainer agree on every response token (docs/DESIGN.md, "The
invariant"). Nothing here re-implements attention or the model: the door to a
bitwise-equal decode path (attention registry, batch-invariant ops) stays open
by changing what load_causal_lm builds, not by forking code here.

Reported log-prob of a sampled token = log_softmax(logits / T)[token] over the
FULL vocabulary (T = 1 in greedy mode). Top-k / top-p truncate the
distribution the token is drawn from but are not part of the scored
distribution, the same convention as SGLang and vLLM; the trainer recomputes
exactly this quantity, so with top_k/top_p active the importance weight is
still 1 at step 1.

Sampling randomness is per sample: sample i of a prompt draws from its own
torch.Generator seeded `prompt.seed + i`, one exponential-race draw per step,
so a sample's tokens do not depend on which other prompts share its batch.
"""
from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from typing import Literal

import torch

from contract.engine_options import TorchEngineConfig
from services.common.determinism import sample_generator
from services.common.models import load_causal_lm
from services.common.weight_stream import LoraAdapterMeta
from services.rollout.config import RolloutServiceConfig
from services.rollout.engine import (
    Engine,
    GeneratedSample,
    GenerationRequest,
    PromptSpec,
    SamplingConfig,
    require_device,
)
from services.rollout.lora_adapter import merged_weight, module_adapters


def _forward_kwargs(model: torch.nn.Module) -> tuple[str, dict[str, int]]:
    """(name of the KV-cache argument, extra kwargs) for this model's forward.

    transformers 5.2x renamed `past_key_values` to `cache`; `logits_to_keep=1`
    skips the lm_head on every prompt position but the last, where the model
    supports it (it changes no value, only work).
    """
    params = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"
    return cache_arg, ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


def left_pad(
    prompts: Sequence[Sequence[int]], pad_token_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts into (input_ids, attention_mask, position_ids), each [B, Lmax] int64.

    Left padding puts every prompt's last token in the last column, so one
    decode step appends one column for the whole batch. Position ids count
    real tokens only (pads get 0 and are masked), so RoPE sees each prompt at
    positions 0..L-1 exactly as in an unpadded forward.
    """
    lmax = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), lmax), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), lmax), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, lmax - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, lmax - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device)


_TOP_P_SCALE = float(2**40)


def truncate_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then top-p (nucleus) on temperature-scaled fp32 logits [B, V]; removed entries become -inf.

    Top-k keeps every logit >= the k-th largest (ties at the boundary are
    kept). Top-p keeps the smallest prefix of the descending order whose mass
    reaches p; the most likely token is always kept. The sort is stable so
    ties are broken by token id, deterministically.
    """
    neg_inf = float("-inf")
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, neg_inf)
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=-1)
        # Cumulative mass in int64 fixed point (2**-40 resolution): an integer
        # prefix sum is exact, so the cut does not depend on the scan order, and
        # torch refuses floating-point cumsum on CUDA in deterministic mode.
        fixed = torch.round(probs.double() * _TOP_P_SCALE).long()
        mass_before = torch.cumsum(fixed, dim=-1) - fixed
        drop = mass_before >= round(top_p * _TOP_P_SCALE)
        drop[:, 0] = False
        ordered = ordered.masked_fill(drop, neg_inf)
        # Undo the sort with a gather (scatter with a tensor src is nondeterministic on CUDA).
        scaled = ordered.gather(-1, torch.argsort(order, dim=-1))
    return scaled


def choose_tokens(
    logits: torch.Tensor,
    sampling: SamplingConfig,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Next token per row of `logits` [B, V]; row b consumes randomness only from generators[b].

    Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d.
    per token is an exact draw from p, and p == 0 (truncated) tokens can never
    win. Each row's noise comes from its own generator, so rows are
    independent of each other and of the batch they sit in.
    """
    if sampling.greedy:
        return logits.argmax(dim=-1)
    scaled = truncate_logits(logits.float() / sampling.temperature, sampling.top_k, sampling.top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.stack(
        [torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g) for g in generators]
    )
    # exponential_ can return exactly 0; clamping keeps p == 0 entries at 0 instead of 0/0 = NaN.
    noise = noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


class TorchEngine(Engine):
    """One Hugging Face causal LM in this process; calls are serialised by the server."""

    name = "torch"

    def __init__(self, config: TorchEngineConfig | None = None) -> None:
        self.config = config or TorchEngineConfig()
        self._device = torch.device(self.config.device)
        self._model: torch.nn.Module | None = None
        self._model_path = ""
        self._policy_version = -1
        self._cache_arg = "cache"
        self._forward_extra: dict[str, int] = {}
        # LoRA: the loaded base weight of every module an adapter has changed (each version is merged
        # into these, never into the previous merge), and a digest of the adapter at the current version.
        self._pristine: dict[str, torch.Tensor] = {}
        self._adapter_digest: str | None = None

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
        self._model, self._model_path = model, str(model_path)
        self._pristine, self._adapter_digest = {}, None
        self._policy_version = int(policy_version)
        self._cache_arg, self._forward_extra = _forward_kwargs(model)

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
        self._model = None

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
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "logprob_backend": self.config.logprob_backend,
        }

    def _require_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("torch engine: no model loaded (call load first)")
        return self._model

    # ------------------------------------------------------------- generate --

    def generate(self, request: GenerationRequest) -> list[GeneratedSample]:
        model = self._require_model()
        self.validate_request(request)
        # Sequence s = (prompt, sample index); output order is prompt order, then index.
        seqs = [(p, i) for p in request.prompts for i in range(request.samples_per_prompt)]
        out: list[GeneratedSample] = []
        step = self.config.max_batch_size
        for start in range(0, len(seqs), step):
            out.extend(self._generate_batch(model, seqs[start : start + step], request.sampling))
        return out

    def validate_request(self, request: GenerationRequest) -> None:
        """Checks that need the model (vocabulary, context length); ValueError names the field."""
        model = self._require_model()
        request.sampling.validate()
        if request.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt: must be >= 1, got {request.samples_per_prompt}")
        if not request.prompts:
            raise ValueError("prompts: empty")
        vocab = model.get_input_embeddings().num_embeddings
        max_len = getattr(model.config, "max_position_embeddings", None)
        for i, p in enumerate(request.prompts):
            if not p.token_ids:
                raise ValueError(f"prompts[{i}].token_ids: empty")
            bad = [t for t in p.token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}].token_ids: id {bad[0]} outside the vocabulary [0, {vocab})")
            if max_len is not None and len(p.token_ids) + request.sampling.max_new_tokens > max_len:
                raise ValueError(
                    f"sampling.max_new_tokens: prompts[{i}] has {len(p.token_ids)} tokens; plus "
                    f"{request.sampling.max_new_tokens} new tokens exceeds max_position_embeddings={max_len}"
                )
        bad_stop = [t for t in request.sampling.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"sampling.stop_token_ids: id {bad_stop[0]} outside the vocabulary [0, {vocab})")

    def _forward(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: object,
    ) -> torch.Tensor:
        """Logits of the last position [B, V]; `cache` is extended in place."""
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: cache},
            **self._forward_extra,
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def _generate_batch(
        self,
        model: torch.nn.Module,
        seqs: list[tuple[PromptSpec, int]],
        sampling: SamplingConfig,
    ) -> list[GeneratedSample]:
        from kernels.logprob import token_logprobs
        from transformers import DynamicCache

        batch = len(seqs)
        pad = self.config.pad_token_id
        stop_ids = set(sampling.stop_token_ids)
        temperature = sampling.logprob_temperature
        generators = [sample_generator(p.seed + i, self._device) for p, i in seqs]

        ids, mask, positions = left_pad([p.token_ids for p, _ in seqs], pad, self._device)
        cache = DynamicCache(config=model.config)
        logits = self._forward(model, ids, mask, positions, cache)
        # Next RoPE position of each row = its own number of real tokens so far.
        next_pos = mask.sum(-1, keepdim=True)

        tokens: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        reasons = ["length"] * batch
        active = list(range(batch))
        for step in range(sampling.max_new_tokens):
            rows = torch.as_tensor(active, device=self._device)
            chosen = choose_tokens(logits[rows], sampling, [generators[b] for b in active])
            logp, _ = token_logprobs(
                logits[rows], chosen, temperature=temperature, backend=self.config.logprob_backend
            )
            chosen_l, logp_l = chosen.tolist(), logp.float().tolist()
            still = []
            for j, b in enumerate(active):
                tokens[b].append(chosen_l[j])
                logprobs[b].append(logp_l[j])
                if chosen_l[j] in stop_ids:
                    reasons[b] = "stop"
                else:
                    still.append(b)
            active = still
            if not active or step == sampling.max_new_tokens - 1:
                break
            # Finished rows stay in the batch (their cache rows are in place) but
            # are fed the pad id and never sampled or reported again.
            feed = torch.full((batch, 1), pad, dtype=torch.long, device=self._device)
            feed[rows.new_tensor(active), 0] = torch.as_tensor(
                [tokens[b][-1] for b in active], dtype=torch.long, device=self._device
            )
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=self._device)], dim=-1)
            logits = self._forward(model, feed, mask, next_pos, cache)
            next_pos = next_pos + 1

        return [
            GeneratedSample(
                group_id=p.group_id,
                index=i,
                token_ids=tokens[b],
                logprobs=logprobs[b],
                finish_reason=reasons[b],
            )
            for b, (p, i) in enumerate(seqs)
        ]

    # ------------------------------------------------------- update weights --

    def update_weights(self, tensors: dict[str, torch.Tensor], policy_version: int) -> None:
        """Verify every tensor against the model, then copy all in; nothing is applied on any error.

        Every model tensor must be sent (a weight left out would silently keep
        the old policy under the new version). Tied aliases (e.g. lm_head /
        embed_tokens) count as one tensor and may be sent under either name.
        Re-sending the loaded version with identical weights is a no-op;
        different weights under the loaded version are refused.
        """
        model = self._require_model()
        targets = model.state_dict(keep_vars=True)
        problems: list[str] = []
        for name, t in tensors.items():
            dst = targets.get(name)
            if dst is None:
                problems.append(f"{name}: not a tensor of the loaded model")
            elif tuple(t.shape) != tuple(dst.shape):
                problems.append(f"{name}: shape {tuple(t.shape)} != model's {tuple(dst.shape)}")
            elif t.dtype != dst.dtype:
                problems.append(f"{name}: dtype {t.dtype} != model's {dst.dtype}")
            elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
                problems.append(f"{name}: non-finite values")
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
            for name, t in tensors.items():
                targets[name].detach().copy_(t.to(targets[name].device))
        # A whole set of weights is a new base: no adapter is merged into it.
        self._pristine, self._adapter_digest = {}, None
        self._policy_version = int(policy_version)

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


def _adapter_digest(meta: LoraAdapterMeta, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(repr((meta.rank, meta.alpha, sorted(meta.target_modules))).encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
