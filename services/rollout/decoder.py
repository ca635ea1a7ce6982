"""The embedded engine's decoder: packed prefill, static KV cache, batched seeded sampling, CUDA graphs.

    decoder = Decoder(model, DecoderOptions(numerics="fast", max_batch_size=256, cuda_graphs=True))
    rows = decoder.decode(prompts, seeds, SamplingConfig(...))   # list[DecodedSequence], in prompt order

A batch of prompts is prefilled as ONE packed [1, T] forward (no padding;
cu_seqlens), each sequence's K/V landing in its own row of a static cache
(services.rollout.kv_cache). Each decode step then runs the stock HF model on
[B, 1] ids with position_ids = each row's length, `use_cache=False`, and the
decoder's attention function, which writes the new K/V and attends over the
row's cached keys. The logits of the last position of every row go through
`kernels.logprob.token_logprobs` (the trainer's log-prob definition) and the
sampler (services.rollout.sampling: one batched call per step; a sample's
tokens depend only on its seed, step and logits).

Numerics modes:
- `fast`: the model's own kernels (cuBLAS etc.). Decode attention: the
  batch-invariant Triton kernel on GPUs (it reads a static cache and captures
  in a graph), torch SDPA with a key mask on CPU. Prefill attention: the
  attention registry's packed backend for the dtype/device, or the
  batch-invariant packed kernel where the registry has none (float32 on a GPU
  in deterministic mode). `Decoder.prefill_attention` / `.decode_attention`
  name them.
- `true_on_policy`: the model patched with `make_batch_invariant` (every
  Linear and RMSNorm on batch-invariant kernels), prefill through
  `packed_attention`, decode through `decode_attention` (same key-block
  reduction order), so a token's log-prob has the same bits as the trainer's
  packed recompute of the whole sequence, whatever else is in the batch.
  torch.compile is never used (fusion changes rounding).

On CUDA the decode step can be captured as a CUDA graph per batch-size bucket
(powers of two up to max_batch_size; padded rows decode a pad token on their
own cache rows and are never reported). Replay runs exactly the captured
kernels, so it gives the eager bits. Weights must change in place
(copy_), as update_weights and the LoRA merge do, for captured graphs to see
them.

Finished rows (a stop token sampled) keep their slot and are fed the pad id;
their later tokens are discarded. Stop detection runs on the device; the host
checks whether every row has finished once every `stop_check_interval` steps
and reads all tokens and log-probs once at the end.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from services.rollout.engine import SamplingConfig
from services.rollout.kv_cache import (
    DECODER_ATTN_IMPLEMENTATION,
    KVStep,
    StaticKVCache,
    register_decoder_attention,
)
from services.rollout.sampling import sample_tokens, seed_words, stream_keys

NUMERICS_MODES = ("fast", "true_on_policy")
CAPACITY_STEP = 256
"""Cache capacity grows in these steps, so requests of similar length reuse one cache and its graphs."""
GRAPH_WARMUP_STEPS = 2


class DecoderUnsupported(ValueError):
    """The model uses something the decoder does not implement (sliding windows, logit softcapping, ...)."""


@dataclass(frozen=True)
class DecoderOptions:
    numerics: str = "fast"
    """'fast' or 'true_on_policy' (see the module docstring)."""
    max_batch_size: int = 64
    """Sequences decoded together; more run as consecutive batches."""
    cuda_graphs: bool = False
    """Capture the decode step as CUDA graphs (CUDA devices only)."""
    max_context_tokens: int | None = None
    """Fixed KV capacity per sequence (prompt + new tokens); None grows it per batch in CAPACITY_STEP steps."""
    pad_token_id: int = 0
    """Id fed to finished and padded rows (never attended by real rows)."""
    logprob_backend: str = "auto"
    """kernels.logprob backend scoring the sampled tokens."""
    stop_check_interval: int = 8
    """Decode steps between host checks of whether every row has stopped."""


@dataclass
class DecodedSequence:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


def check_decodable(model: torch.nn.Module) -> None:
    """DecoderUnsupported naming what this decoder cannot run for `model`."""
    cfg = model.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()) or getattr(cfg, "use_sliding_window", False):
        raise DecoderUnsupported(f"{type(model).__name__}: sliding-window attention layers are not supported")
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "attn_logit_softcapping", None):
        raise DecoderUnsupported(f"{type(model).__name__}: logit softcapping is not supported")
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        raise DecoderUnsupported(f"{type(model).__name__}: the output head is not an nn.Linear")
    if not hasattr(model, getattr(model, "base_model_prefix", "")):
        raise DecoderUnsupported(f"{type(model).__name__}: no base model under base_model_prefix")


@contextlib.contextmanager
def decoder_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` with the decoder's attention function inside the block; its own implementation after.

    Outside a decode the model stays a stock HF module (so anything else that scores with it keeps working)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(register_decoder_attention())
    if model.config._attn_implementation != DECODER_ATTN_IMPLEMENTATION:
        raise DecoderUnsupported(f"{type(model).__name__}: its attention implementation cannot be set "
                                 "(it does not dispatch through transformers' AttentionInterface)")
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _bucket(n: int, max_batch_size: int) -> int:
    return min(1 << (n - 1).bit_length(), max_batch_size)


class _CapturedDecodeStep:
    """One decode step of a fixed batch size captured as a CUDA graph, with its static input/output buffers."""

    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], rows: int,
                 pad_token_id: int, device: torch.device, pool) -> None:
        self.ids = torch.full((rows, 1), pad_token_id, dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.lengths = torch.ones(rows, dtype=torch.int32, device=device)
        # Warm-up compiles the Triton kernels and settles allocations; it writes cache position 0 of these rows,
        # which the prefill that follows overwrites.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_STEPS):
                step(self.ids, self.positions, self.lengths)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (the server's) does not invalidate this capture.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = step(self.ids, self.positions, self.lengths)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if ids is not self.ids:
            raise RuntimeError("captured decode step replayed with buffers other than its own")
        self.graph.replay()
        return self.logits


class Decoder:
    """Decodes batches of prompts with one HF causal LM (which it may patch: see `numerics`)."""

    def __init__(self, model: torch.nn.Module, options: DecoderOptions) -> None:
        if options.numerics not in NUMERICS_MODES:
            raise ValueError(f"numerics: {options.numerics!r} is not one of {list(NUMERICS_MODES)}")
        for name in ("max_batch_size", "stop_check_interval"):
            if getattr(options, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(options, name)}")
        if options.max_context_tokens is not None and options.max_context_tokens < 1:
            raise ValueError(f"max_context_tokens: must be >= 1 or None, got {options.max_context_tokens}")
        check_decodable(model)
        self.model, self.options = model, options
        self.device = next(model.parameters()).device
        if options.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, the model is on {self.device}")
        from kernels.batch_invariant import decode_attention

        self._decode_attention, self.decode_attention = decode_attention, "batch_invariant"
        if options.numerics == "fast" and self.device.type == "cpu":
            # The batch-invariant CPU kernel walks key blocks in Python; fast mode promises no bits.
            self._decode_attention, self.decode_attention = _sdpa_decode_attention, "sdpa"
        if options.numerics == "true_on_policy":
            from kernels.batch_invariant import packed_attention
            from kernels.batch_invariant.hf import make_batch_invariant

            make_batch_invariant(model)
            self._packed_attention, self.prefill_attention = packed_attention, "batch_invariant"
        else:
            self._packed_attention, self.prefill_attention = _fast_prefill_attention(model, self.device)
        self._base = getattr(model, model.base_model_prefix)
        self._head = model.get_output_embeddings()
        cfg = model.config
        self._shape = dict(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                           head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                           dtype=next(model.parameters()).dtype, device=self.device)
        self._cache: StaticKVCache | None = None
        self._graphs: dict[int, _CapturedDecodeStep] = {}
        self._graph_pool = None

    def release(self) -> None:
        """Free the cache and the captured graphs (they are rebuilt on the next decode)."""
        self._cache, self._graphs, self._graph_pool = None, {}, None

    # ---------------------------------------------------------------- decode --

    # no_grad, not inference_mode: the attention registry keys its layout checks on tensor version counters.
    @torch.no_grad()
    def decode(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
               sampling: SamplingConfig) -> list[DecodedSequence]:
        """One DecodedSequence per prompt, in order; prompt i samples from the stream of seeds[i]."""
        if len(prompts) != len(seeds):
            raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
        sampling.validate()
        cap = self.options.max_context_tokens
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}]: empty")
            if cap is not None and len(p) + sampling.max_new_tokens > cap:
                raise ValueError(f"sampling.max_new_tokens: prompts[{i}] has {len(p)} tokens; plus "
                                 f"{sampling.max_new_tokens} new tokens exceeds max_context_tokens={cap}")
        out: list[DecodedSequence] = []
        step = self.options.max_batch_size
        with decoder_attention(self.model):
            for start in range(0, len(prompts), step):
                out.extend(self._decode_batch(prompts[start:start + step], seeds[start:start + step], sampling))
        return out

    def _ensure_cache(self, rows: int, need: int) -> None:
        capacity = self.options.max_context_tokens or -(-need // CAPACITY_STEP) * CAPACITY_STEP
        if self._cache is not None and self._cache.fits(rows, capacity):
            return
        if self._cache is not None:
            rows, capacity = max(rows, self._cache.rows), max(capacity, self._cache.capacity)
        # Graphs hold the old cache's addresses: drop them with it, before allocating the new one.
        self._cache, self._graphs, self._graph_pool = None, {}, None
        self._cache = StaticKVCache(rows=rows, capacity=capacity, **self._shape)

    def _step_fn(self, rows: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        if not self.options.cuda_graphs:
            return self._decode_logits
        graph = self._graphs.get(rows)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = _CapturedDecodeStep(self._decode_logits, rows, self.options.pad_token_id, self.device,
                                        self._graph_pool)
            self._graphs[rows] = graph
        return graph

    def _decode_batch(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int],
                      sampling: SamplingConfig) -> list[DecodedSequence]:
        from kernels.logprob import token_logprobs

        n, new = len(prompts), sampling.max_new_tokens
        rows = _bucket(n, self.options.max_batch_size) if self.options.cuda_graphs else n
        self._ensure_cache(rows, max(len(p) for p in prompts) + new)
        step_fn = self._step_fn(rows)  # captured before the prefill: capture warm-up writes the cache
        if isinstance(step_fn, _CapturedDecodeStep):
            ids, positions, lengths = step_fn.ids, step_fn.positions, step_fn.lengths
        else:
            ids = torch.empty((rows, 1), dtype=torch.int64, device=self.device)
            positions = torch.empty((rows, 1), dtype=torch.int64, device=self.device)
            lengths = torch.empty(rows, dtype=torch.int32, device=self.device)
        prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=self.device)
        ids.fill_(self.options.pad_token_id)
        positions.zero_()
        positions[:n, 0] = prompt_lengths  # the first sampled token sits right after its prompt
        lengths.copy_(positions[:, 0] + 1)

        logits = self._prefill_logits(prompts)
        keys = stream_keys(seed_words(seeds, self.device), new)
        stops = torch.tensor(sorted(set(sampling.stop_token_ids)), dtype=torch.int64, device=self.device)
        tokens = torch.empty((n, new), dtype=torch.int64, device=self.device)
        logps = torch.empty((n, new), dtype=torch.float32, device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        steps = new
        for step in range(new):
            chosen = sample_tokens(logits[:n], sampling, keys[step])
            logp, _ = token_logprobs(logits[:n], chosen, temperature=sampling.logprob_temperature,
                                     backend=self.options.logprob_backend)
            tokens[:, step] = chosen
            logps[:, step] = logp.float()
            if stops.numel():
                done |= torch.isin(chosen, stops)
            if step == new - 1:
                break
            if stops.numel() and (step + 1) % self.options.stop_check_interval == 0 and bool(done.all()):
                steps = step + 1
                break
            ids[:n, 0] = torch.where(done, self.options.pad_token_id, chosen)
            logits = step_fn(ids, positions, lengths)
            positions += 1
            lengths += 1
        return _trim(tokens[:, :steps].tolist(), logps[:, :steps].tolist(), set(sampling.stop_token_ids))

    # -------------------------------------------------------------- forwards --

    def _prefill_logits(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Logits [S, V] of each prompt's last position, from one packed forward that fills cache rows 0..S-1."""
        lens = [len(p) for p in prompts]
        dev = self.device
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(dev)
        rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(dev)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        kv = KVStep.prefill(self._cache, rows, positions, cu.to(dev), max(lens), self._packed_attention)
        hidden = self._base(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                            lockstep_kv=kv).last_hidden_state[0]
        return self._head(hidden[cu[1:].to(dev).long() - 1])

    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one decode step: ids/positions [B, 1] int64, lengths int32 [B] = positions + 1."""
        kv = KVStep.decode_step(self._cache, positions[:, 0], lengths, self._decode_attention)
        hidden = self._base(input_ids=ids, position_ids=positions, use_cache=False, lockstep_kv=kv).last_hidden_state
        return self._head(hidden[:, -1])


def _sdpa_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """decode_attention's contract through torch SDPA with a key mask (fast mode on CPU, where reading
    the lengths costs no device sync): row b attends keys [0, lengths[b]) of cache row b."""
    used = int(lengths.max())
    keys = torch.arange(used, device=q.device)
    mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, used]
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k_cache[:, :, :used], v_cache[:, :, :used], attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k_cache.shape[1])
    return out[:, :, 0]


def _fast_prefill_attention(model: torch.nn.Module, device: torch.device) -> tuple[Callable, str]:
    """(packed attention fn, its name) of fast-mode prefill: the attention registry's choice for this
    dtype/device/head size, or, where the registry has no backend for it (float32 on a GPU under
    deterministic algorithms: its fused backends are 16-bit, its reference not deterministic there), the
    batch-invariant packed kernel, which serves every dtype the decoder runs. Engine info reports which."""
    from kernels.attention import REGISTRY, AttentionBackendError, PackedLayout

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    try:
        backend = REGISTRY.select(device=device, dtype=next(model.parameters()).dtype, head_dim=head_dim,
                                  packed=True, window=None)
    except AttentionBackendError:
        if REGISTRY.policy.backend is not None:
            raise  # a backend forced by policy is never replaced
        from kernels.batch_invariant import packed_attention

        return packed_attention, "batch_invariant"

    def registry_attention(q, k, v, cu_seqlens, max_seqlen, scale):
        return REGISTRY.attention(q, k, v, PackedLayout(cu_seqlens, max_seqlen), scale=scale)

    return registry_attention, backend.name


def _trim(tokens: list[list[int]], logps: list[list[float]], stops: set[int]) -> list[DecodedSequence]:
    """Cut each row after its first stop token (included); rows without one finished by length."""
    out = []
    for toks, lps in zip(tokens, logps):
        end = next((i + 1 for i, t in enumerate(toks) if t in stops), None)
        if end is None:
            out.append(DecodedSequence(toks, lps, "length"))
        else:
            out.append(DecodedSequence(toks[:end], lps[:end], "stop"))
    return out
