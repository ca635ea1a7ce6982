"""The embedded engine's decoder: continuous batching over a paged KV pool, batched seeded sampling, CUDA graphs.

    decoder = Decoder(model, DecoderOptions(numerics="fast", max_batch_size=256, cuda_graphs=True))
    rows = decoder.decode(prompts, seeds, SamplingConfig(...))   # list[DecodedSequence], in prompt order

Sequences are scheduled by services.rollout.embedded.scheduler: waiting sequences are admitted as rows and pages free
up, prefilled in packed chunks of at most `prefill_chunk_tokens` tokens (one [1, T] forward, no padding,
cu_seqlens) interleaved with decode steps, and a finished row gives its pages back at once. The n samples
of a prompt share its prefill and its pages (copy on write of the partly filled last page). When the pool
runs out of pages the latest admitted sequence is preempted and later recomputed from its tokens.

Each decode step runs the stock HF model on [B, 1] ids with position_ids = each row's position,
`use_cache=False`, and the decoder's attention function (services.rollout.embedded.kv_cache), which writes the new
K/V into the row's page and attends over the row's pages. The logits of every row go through
`kernels.logprob.token_logprobs` (the trainer's log-prob definition) and the sampler (kernels.sampling: one
batched call per step; a sample's tokens depend only on its seed, its step and its logits).

Numerics modes:
- `fast`: the model's own kernels (cuBLAS etc.). Decode attention: the batch-invariant paged Triton kernel
  on GPUs (it captures in a graph), torch SDPA over the gathered pages on CPU. Prefill attention: the
  attention registry's packed backend (or the batch-invariant packed kernel where the registry has none)
  when every sequence of a chunk starts at position 0, the batch-invariant paged kernel otherwise.
  `Decoder.prefill_attention` / `.decode_attention` name them.
- `true_on_policy`: the model patched with `make_batch_invariant` (every Linear and RMSNorm on
  batch-invariant kernels), prefill and decode through the paged batch-invariant attention (a page is one
  key block, so the reduction order is that of packed attention over the whole sequence). A token's
  log-prob then has the same bits as the trainer's packed recompute of the whole sequence, whatever else
  is in the batch, however its prefill was chunked, whether its prompt's pages were shared, and whether
  its K/V was written by decode steps or recomputed after a preemption. Decode steps run the model's
  parameters through fused kernels of the same bits (services.rollout.embedded.fused_step; `decode_forward` says
  "fused", or "hf" for a model it does not cover or with `fused_step=False`).
  torch.compile is never used (fusion changes rounding).

On CUDA the decode step can be captured as a CUDA graph per batch-size bucket (powers of two up to
max_batch_size; padded rows decode a pad token into the scratch page and are never reported). Replay runs
exactly the captured kernels, so it gives the eager bits. Weights must change in place (copy_), as
update_weights and the LoRA merge do, for captured graphs to see them.

The host reads each step's tokens (to free finished rows' pages at once and to schedule the next step).
`decode(..., should_pause=...)` stops at a token boundary and returns every unfinished sequence with
finish_reason "paused"; `prefixes` continues sequences from tokens sampled earlier (their K/V recomputed).

`decode(..., keys=...)` keeps K/V across calls (a multi-turn episode's turns): a keyed sequence keeps its
pages when it finishes, and the next call's sequence under that key whose prompt extends those tokens
prefills only the new suffix (scheduler.KeptPrefixes). In true_on_policy its tokens and log-probs have the
bits of a full re-prefill: each position's K/V has the same bits whether a decode step or a packed prefill
wrote it. Kept pages go when their owner says (`forget`), when the weights change (`weights_changed`),
when the pool is freed, and under pool pressure (evicted before any running sequence is preempted).
`take_counters()` adds up prefill and reused tokens and why a kept prefix could not be reused.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.sampling import sample_tokens as sample_from_keys
from kernels.sampling import seed_words
from services.rollout.embedded.decoder_attention import (
    check_decodable,
    decoder_attention,
    fast_prefill_attention,
    sdpa_paged_decode,
)
from services.rollout.embedded.kv_cache import PAGE_TOKENS, KVStep, PagedKVPool
from services.rollout.embedded.routing_record import RoutingRecorder
from services.rollout.embedded.scheduler import (
    DecodeSequence, KeptPrefixes, PageAllocator, Scheduler, Unit, pages_for,
)
from services.rollout.embedded.step_inputs import StepInputs
from services.rollout.types import PrefillCounts, SamplingConfig

NUMERICS_MODES = ("fast", "true_on_policy")
SCHEDULERS = ("continuous", "static")
GRAPH_WARMUP_STEPS = 2
DEFAULT_TABLE_TOKENS = 1 << 15
"""Block-table width (in tokens) when neither max_context_tokens nor the model bounds a sequence."""


@dataclass(frozen=True)
class DecoderOptions:
    numerics: str = "fast"
    """'fast' or 'true_on_policy' (see the module docstring)."""
    max_batch_size: int = 64
    """Most sequences decoded together (rows of a decode step)."""
    cuda_graphs: bool = False
    """Capture the decode step as CUDA graphs (CUDA devices only)."""
    max_context_tokens: int | None = None
    """Longest sequence (prompt + new tokens) accepted; also the width of the block tables."""
    pad_token_id: int = 0
    """Id fed to padded rows (and to a static batch's finished rows); never attended by real rows."""
    logprob_backend: str = "auto"
    """kernels.logprob backend scoring the sampled tokens."""
    kv_pool_tokens: int | None = None
    """KV pool size in tokens (rounded up to whole pages); fixed once allocated."""
    kv_pool_memory_fraction: float | None = None
    """KV pool size as this fraction of the device memory free when the pool is first allocated (CUDA only)."""
    prefill_chunk_tokens: int = 8192
    """Most tokens of one prefill forward; longer prompts are prefilled over several iterations."""
    share_prompts: bool = True
    """The samples of one prompt share its prefill and its pages."""
    scheduler: str = "continuous"
    """'continuous' (admit as rows and pages free up) or 'static' (a batch at a time, finished rows kept until
    the batch ends: the baseline a benchmark compares against)."""
    fused_step: bool = True
    """true_on_policy: run decode steps on the fused batch-invariant kernels (services.rollout.embedded.fused_step), the
    stock forward's bits in fewer launches, where the model allows; False: always the stock forward."""


@dataclass
class DecodedSequence:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "paused"
    routed_experts: torch.Tensor | None = None  # MoE: [prompt + tokens, layers, k] (routing_record.py)


@dataclass
class DecodeStats:
    """What the last decode did (benchmarks and tests read it)."""

    prefill_tokens: int = 0
    reused_tokens: int = 0
    """Prompt tokens admitted onto K/V kept from an earlier call (not prefilled)."""
    decode_steps: int = 0
    row_steps: int = 0
    """Sum over decode steps of the rows stepped (useful or not)."""
    useful_row_steps: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    pool_pages: int = 0
    live_kv_tokens: int = 0
    """Sum over decode steps of the rows' context lengths (the K/V a step reads)."""
    page_copies: int = 0
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    """(rows, context tokens read, seconds) of every decode step; seconds from the end of the previous host
    read to this step's read of its tokens (the host syncs on every step's tokens)."""
    prefill_seconds: float = 0.0
    device_steps: list[tuple[float, float]] = field(default_factory=list)
    """CUDA only, per decode step as in `steps`: device seconds of (the forward, the forward and sampling),
    from CUDA events around them; the rest of a step's seconds is host time the device waited for."""


def _bucket(n: int, max_batch_size: int) -> int:
    return min(1 << (n - 1).bit_length(), max_batch_size)


class _CapturedDecodeStep:
    """One decode step of a fixed batch size captured as a CUDA graph, with its static input/output buffers."""

    def __init__(self, step: Callable[..., torch.Tensor], rows: int, table_width: int, pad_token_id: int,
                 device: torch.device, pool) -> None:
        self.ids = torch.full((rows, 1), pad_token_id, dtype=torch.int64, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.int64, device=device)
        self.lengths = torch.ones(rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros((rows, table_width), dtype=torch.int32, device=device)
        # Warm-up compiles the Triton kernels and settles allocations; it writes the scratch page only.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(GRAPH_WARMUP_STEPS):
                step(self.ids, self.positions, self.lengths, self.tables)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a CUDA call from another thread (the server's) does not invalidate this capture.
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = step(self.ids, self.positions, self.lengths, self.tables)

    def __call__(self, ids, positions, lengths, tables) -> torch.Tensor:
        if ids is not self.ids:
            raise RuntimeError("captured decode step replayed with buffers other than its own")
        self.graph.replay()
        return self.logits


class Decoder:
    """Decodes prompts with one HF causal LM (which it may patch: see `numerics`)."""

    def __init__(self, model: torch.nn.Module, options: DecoderOptions) -> None:
        if options.numerics not in NUMERICS_MODES:
            raise ValueError(f"numerics: {options.numerics!r} is not one of {list(NUMERICS_MODES)}")
        if options.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler: {options.scheduler!r} is not one of {list(SCHEDULERS)}")
        for name in ("max_batch_size", "prefill_chunk_tokens"):
            if getattr(options, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(options, name)}")
        for name in ("max_context_tokens", "kv_pool_tokens"):
            if getattr(options, name) is not None and getattr(options, name) < 1:
                raise ValueError(f"{name}: must be >= 1 or None, got {getattr(options, name)}")
        frac = options.kv_pool_memory_fraction
        if frac is not None and not 0 < frac < 1:
            raise ValueError(f"kv_pool_memory_fraction: must be in (0, 1), got {frac}")
        if frac is not None and options.kv_pool_tokens is not None:
            raise ValueError("kv_pool_memory_fraction: set either it or kv_pool_tokens, not both")
        check_decodable(model)
        self.model, self.options = model, options
        self.device = next(model.parameters()).device
        if options.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, the model is on {self.device}")
        if frac is not None and self.device.type != "cuda":
            raise ValueError(f"kv_pool_memory_fraction: sizes the pool from CUDA memory; the model is on "
                             f"{self.device} (set kv_pool_tokens)")
        from kernels.batch_invariant import paged_decode_attention, paged_prefill_attention

        self._paged_decode, self.decode_attention = paged_decode_attention, "batch_invariant"
        self._paged_prefill = paged_prefill_attention
        if options.numerics == "fast" and self.device.type == "cpu":
            # The batch-invariant CPU kernel walks key blocks in Python; fast mode promises no bits.
            self._paged_decode, self.decode_attention = sdpa_paged_decode, "sdpa"
        self._fused, self.decode_forward = None, "hf"
        if options.numerics == "true_on_policy":
            from kernels.batch_invariant.hf import make_batch_invariant
            from services.rollout.embedded.fused_step import FusedDecodeStep, unsupported_reason

            make_batch_invariant(model)
            self._packed_attention, self.prefill_attention = None, "batch_invariant"
            if options.fused_step and unsupported_reason(model) is None:
                self._fused, self.decode_forward = FusedDecodeStep(model), "fused"
        else:
            self._packed_attention, self.prefill_attention = fast_prefill_attention(model, self.device)
        self._base = getattr(model, model.base_model_prefix)
        self._head = model.get_output_embeddings()
        self.routing = RoutingRecorder(model, options.max_batch_size, self.device)
        cfg = model.config
        self._shape = dict(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                           head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                           dtype=next(model.parameters()).dtype)
        longest = options.max_context_tokens or getattr(cfg, "max_position_embeddings", None) or DEFAULT_TABLE_TOKENS
        self.table_width = pages_for(longest)
        self._pool: PagedKVPool | None = None
        self._graphs: dict[int, _CapturedDecodeStep] = {}
        self._graph_pool = None
        self._inputs: StepInputs | None = None
        self._kept: KeptPrefixes | None = None  # with the pool: its allocator and the kept prefixes
        self.stats = DecodeStats()
        self._counters = PrefillCounts()

    @property
    def max_sequence_tokens(self) -> int:
        """Longest sequence (prompt plus new tokens) decode() accepts."""
        longest = self.table_width * PAGE_TOKENS
        cap = self.options.max_context_tokens
        return longest if cap is None else min(cap, longest)

    def release(self) -> None:
        """Free the pool (and the prefixes kept in it) and the captured graphs (rebuilt on the next decode)."""
        if self._kept is not None:
            self._kept.drop_all("released")
        self._pool, self._graphs, self._graph_pool, self._inputs = None, {}, None, None

    def forget(self, keys: Sequence[str]) -> None:
        """Release what is kept under `keys` (their episodes ended); nothing counts as a miss later."""
        if self._kept is not None:
            for key in keys:
                self._kept.drop(key)

    def weights_changed(self) -> None:
        """The model's weights changed: every kept K/V is stale (a later turn re-prefills, counted 'weights')."""
        if self._kept is not None:
            self._kept.drop_all("weights")

    @property
    def kept_prefixes(self) -> KeptPrefixes | None:
        """The allocator's holders between calls (tests read it: no sequence holds a page then)."""
        return self._kept

    def take_counters(self) -> PrefillCounts:
        """Totals since the last call (prefill and reused tokens, misses by reason), then zero."""
        out = self._counters
        if self._kept is not None:
            out.misses = dict(self._kept.misses)
            self._kept.misses.clear()
        self._counters = PrefillCounts()
        return out

    @property
    def page_bytes(self) -> int:
        return PagedKVPool.page_bytes(**{k: v for k, v in self._shape.items()})

    # ---------------------------------------------------------------- decode --

    # no_grad, not inference_mode: the attention registry keys its layout checks on tensor version counters.
    @torch.no_grad()
    def decode(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], sampling: SamplingConfig, *,
               prefixes: Sequence[tuple[Sequence[int], Sequence[float]] | None] | None = None,
               should_pause: Callable[[], bool] | None = None,
               keys: Sequence[str | None] | None = None) -> list[DecodedSequence]:
        """One DecodedSequence per prompt, in order; prompt i samples from the stream of seeds[i].

        prefixes[i], if given, holds tokens (and their log-probs) sampled for prompt i earlier: decoding
        continues after them at their step of the stream (its K/V recomputed under the current weights), and
        they count towards max_new_tokens. should_pause is asked before every iteration; once it answers True
        every unfinished sequence comes back with finish_reason 'paused' and the tokens it has. keys[i], if
        given, keeps sequence i's K/V after it finishes under that key and starts it from the K/V kept under
        it, when prompt i extends those tokens (see the module docstring); keys are distinct."""
        if len(prompts) != len(seeds):
            raise ValueError(f"seeds: {len(seeds)} seeds for {len(prompts)} prompts")
        prefixes = list(prefixes) if prefixes is not None else [None] * len(prompts)
        if len(prefixes) != len(prompts):
            raise ValueError(f"prefixes: {len(prefixes)} for {len(prompts)} prompts")
        keys = list(keys) if keys is not None else [None] * len(prompts)
        if len(keys) != len(prompts):
            raise ValueError(f"keys: {len(keys)} for {len(prompts)} prompts")
        named = [k for k in keys if k is not None]
        if len(set(named)) != len(named):
            raise ValueError("keys: a key is given to more than one prompt")
        sampling.validate()
        cap = self.options.max_context_tokens
        longest = self.table_width * PAGE_TOKENS
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}]: empty")
            total = len(p) + sampling.max_new_tokens
            if cap is not None and total > cap:
                raise ValueError(f"sampling.max_new_tokens: prompts[{i}] has {len(p)} tokens; plus "
                                 f"{sampling.max_new_tokens} new tokens exceeds max_context_tokens={cap}")
            if total > longest:
                raise ValueError(f"sampling.max_new_tokens: prompts[{i}] has {len(p)} tokens; plus "
                                 f"{sampling.max_new_tokens} new tokens exceeds the longest sequence ({longest})")
            pre = prefixes[i]
            if pre is not None:
                if len(pre[0]) != len(pre[1]):
                    raise ValueError(f"prefixes[{i}]: {len(pre[0])} tokens but {len(pre[1])} log-probs")
                if len(pre[0]) >= sampling.max_new_tokens:
                    raise ValueError(f"prefixes[{i}]: {len(pre[0])} tokens already reach max_new_tokens="
                                     f"{sampling.max_new_tokens}")
        seqs = [DecodeSequence(i, len(p), list(p) + list(pre[0] if pre else ()), len(p) + sampling.max_new_tokens,
                    logprobs=[float(x) for x in (pre[1] if pre else ())], key=key)
                for i, (p, pre, key) in enumerate(zip(prompts, prefixes, keys))]
        stops = frozenset(sampling.stop_token_ids)
        for s in seqs:  # a resumed sequence whose last token was a stop is already finished
            if s.generated and s.tokens[-1] in stops:
                s.finish_reason = "stop"
        self._ensure_pool(seqs)
        hashes = seed_hashes_of(seeds, self.device)
        self.routing.start(seqs)
        with decoder_attention(self.model):
            self._run(seqs, self._units(seqs), hashes, sampling, stops, should_pause)
        return [DecodedSequence(s.tokens[s.prompt_len:], s.logprobs, s.finish_reason or "paused",
                                self.routing.table(s)) for s in seqs]

    def _units(self, seqs: list[DecodeSequence]) -> list[Unit]:
        """Consecutive sequences with the same known tokens share one prefill (at most max_batch_size each)."""
        units: list[Unit] = []
        for s in seqs:
            if s.finish_reason is not None:
                continue
            last = units[-1] if units else None
            if (self.options.share_prompts and last is not None and last.leader.tokens == s.tokens
                    and len(last.members) < self.options.max_batch_size):
                last.members.append(s)
            else:
                units.append(Unit([s]))
        return units

    def _ensure_pool(self, seqs: list[DecodeSequence]) -> None:
        """Allocate the pool once (or, with no size configured, grow it to this request's dense need)."""
        opts = self.options
        longest = max(s.max_tokens for s in seqs)
        if opts.kv_pool_tokens is not None:
            pages = pages_for(opts.kv_pool_tokens) + 1
        elif opts.kv_pool_memory_fraction is not None:
            if self._pool is None:
                free = torch.cuda.mem_get_info(self.device)[0]
                pages = int(opts.kv_pool_memory_fraction * free) // self.page_bytes
            else:
                pages = self._pool.pages
        else:
            rows = min(len(seqs), opts.max_batch_size)
            # Beside the request's dense need, room for what other sequences keep (so it is not evicted).
            mine = {s.key for s in seqs}
            held = sum(len(e.pages) for k, e in self._kept.entries.items() if k not in mine) if self._kept else 0
            pages = rows * pages_for(longest) + 1 + held
            if self._pool is not None:
                pages = max(pages, self._pool.pages)
        field_name = "kv_pool_tokens" if opts.kv_pool_memory_fraction is None else "kv_pool_memory_fraction"
        if pages - 1 < pages_for(longest):
            raise ValueError(f"{field_name}: the KV pool holds {(pages - 1) * PAGE_TOKENS} tokens, less than one "
                             f"sequence of {longest} tokens (prompt + max_new_tokens) needs")
        if self._pool is not None and self._pool.pages == pages:
            return
        # Graphs hold the old pool's addresses: drop them with it, before allocating the new one. A grown
        # pool keeps the old one's pages (same indices, same bits) when prefixes are kept in them.
        grown = self._pool is not None
        old = self._pool if grown and self._kept.entries else None  # else freed before the new one is made
        self._pool, self._graphs, self._graph_pool = None, {}, None
        self._pool = PagedKVPool(pages=pages, device=self.device, **self._shape)
        if old is not None:
            self._pool.copy_pages_from(old)
            del old
        if grown:
            self._kept.alloc.grow(pages)
        elif self._kept is None:
            self._kept = KeptPrefixes(PageAllocator(pages))
        else:  # a pool after release(), which dropped everything kept
            self._kept.alloc = PageAllocator(pages)

    def _run(self, seqs: list[DecodeSequence], units: list[Unit], hashes: torch.Tensor, sampling: SamplingConfig,
             stops: frozenset[int], should_pause: Callable[[], bool] | None) -> None:
        opts = self.options
        chunk = opts.prefill_chunk_tokens if opts.scheduler == "continuous" else 1 << 62  # static: one prefill
        sched = Scheduler(kept=self._kept, max_rows=opts.max_batch_size, chunk_tokens=chunk, policy=opts.scheduler)
        self.stats = stats = DecodeStats(pool_pages=self._pool.pages)
        if self._inputs is None:
            self._inputs = StepInputs(opts.max_batch_size, self.table_width, self.device)
        self._inputs.reset()
        for unit in units:
            sched.submit(unit)
        try:
            self._loop(sched, hashes, sampling, stops, should_pause)
        finally:
            sched.close()  # a paused (or failed) call's sequences give their pages back
            stats.prefill_tokens, stats.reused_tokens = sched.prefill_tokens, sched.reused_tokens
            stats.preemptions = sched.preemptions
            self._counters.prefill_tokens += sched.prefill_tokens
            self._counters.reused_tokens += sched.reused_tokens

    def _loop(self, sched: Scheduler, hashes: torch.Tensor, sampling: SamplingConfig, stops: frozenset[int],
              should_pause: Callable[[], bool] | None) -> None:
        stats = self.stats
        while not sched.done:
            if should_pause is not None and should_pause():
                break
            sched.admit()
            for src, dst in sched.take_copies():  # kept pages an admitted prefill writes into
                self._pool.copy_page(src, dst)
                stats.page_copies += 1
            pieces = sched.prefill_chunk()
            if pieces:
                t0 = time.perf_counter()
                self._prefill(pieces, sched, hashes, sampling, stops)
                stats.prefill_seconds += time.perf_counter() - t0
            rows = sched.decode_batch()
            for src, dst in sched.take_copies():
                self._pool.copy_page(src, dst)
                stats.page_copies += 1
            stats.peak_pages = max(stats.peak_pages, self._pool.pages - 1 - sched.alloc.free)
            if rows:
                self._decode(rows, sched, hashes, sampling, stops)
            elif not pieces and not sched.done:
                raise RuntimeError("decoder: the scheduler made no progress (a bug)")

    def _sample(self, logits: torch.Tensor, members: list[DecodeSequence], hashes: torch.Tensor,
                sampling: SamplingConfig) -> tuple[list[int], list[float]]:
        return self._read_sampled(self._launch_sampling(logits, members, hashes, sampling), len(members))

    def _launch_sampling(self, logits: torch.Tensor, members: list[DecodeSequence], hashes: torch.Tensor,
                         sampling: SamplingConfig) -> torch.Tensor:
        """float64 [2n] on the device: `members`' sampled tokens, then their log-probs (token ids up to 2^53
        and fp32 log-probs are exact in float64, so one read returns both). One upload of their stream keys."""
        from kernels.logprob import token_logprobs
        from kernels.sampling import keys_at

        idx, steps = self._inputs.keys(members)
        chosen = sample_tokens(logits, sampling, keys_at(hashes[idx], steps))
        logp, _ = token_logprobs(logits, chosen, temperature=sampling.logprob_temperature,
                                 backend=self.options.logprob_backend)
        return torch.cat([chosen.to(torch.float64), logp.float().to(torch.float64)])

    @staticmethod
    def _read_sampled(both: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
        values = both.tolist()  # the host's one wait for the device per step
        return [int(t) for t in values[:n]], values[n:]

    def _prefill(self, pieces, sched: Scheduler, hashes: torch.Tensor, sampling: SamplingConfig,
                 stops: frozenset[int]) -> None:
        """One packed forward over the pieces; members of units it completes sample their next token."""
        dev = self.device
        ids, positions, pages, slots, lens, starts = [], [], [], [], [], []
        tables = torch.zeros((len(pieces), self.table_width), dtype=torch.int32)
        for i, piece in enumerate(pieces):
            lead = piece.unit.leader
            ids += lead.tokens[piece.start:piece.end]
            pos = list(range(piece.start, piece.end))
            positions += pos
            pages += [lead.pages[p // PAGE_TOKENS] for p in pos]
            slots += [p % PAGE_TOKENS for p in pos]
            lens.append(piece.end - piece.start)
            starts.append(piece.start)
            tables[i, :len(lead.pages)] = torch.tensor(lead.pages, dtype=torch.int32)
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens), 0)
        cu_dev, max_len = cu.to(dev), max(lens)
        if self._packed_attention is not None and not any(starts):
            packed = self._packed_attention

            def attend(q, k, v, k_pool, v_pool, scale):
                return packed(q, k, v, cu_dev, max_len, scale)
        else:
            paged, tables_dev = self._paged_prefill, tables.to(dev)
            starts_dev = torch.tensor(starts, dtype=torch.int32, device=dev)

            def attend(q, k, v, k_pool, v_pool, scale):
                return paged(q, k_pool, v_pool, tables_dev, cu_dev, starts_dev, max_len, scale)
        kv = KVStep.prefill(self._pool, torch.tensor(pages, dtype=torch.int64, device=dev),
                            torch.tensor(slots, dtype=torch.int64, device=dev), attend)
        pos_dev = torch.tensor(positions, dtype=torch.int64, device=dev)
        hidden = self._base(input_ids=torch.tensor(ids, dtype=torch.int64, device=dev)[None],
                            position_ids=pos_dev[None], use_cache=False, lockstep_kv=kv).last_hidden_state[0]
        self.routing.prefill(pieces, cu)
        finishing = [(i, piece) for i, piece in enumerate(pieces) if piece.completes]
        for piece in pieces:
            sched.prefilled(piece)
        if not finishing:
            return
        members = [s for _, piece in finishing for s in piece.unit.members]
        # One logits row per completed unit; each member draws from it with its own key.
        last = torch.tensor([int(cu[i + 1]) - 1 for i, piece in finishing for _ in piece.unit.members],
                            dtype=torch.int64, device=dev)
        tokens, logps = self._sample(self._head(hidden[last]), members, hashes, sampling)
        for s, t, lp in zip(members, tokens, logps):
            sched.sampled(s, t, lp, stops)

    def _decode(self, rows: list[DecodeSequence], sched: Scheduler, hashes: torch.Tensor, sampling: SamplingConfig,
                stops: frozenset[int]) -> None:
        t0 = time.perf_counter()
        n = len(rows)
        bucket = _bucket(n, self.options.max_batch_size) if self.options.cuda_graphs else n
        step_fn = self._step_fn(bucket)
        inputs = self._inputs
        context = inputs.stage(rows, bucket, self.options.pad_token_id)
        if isinstance(step_fn, _CapturedDecodeStep):
            bufs = (step_fn.ids, step_fn.positions, step_fn.lengths, step_fn.tables)
            inputs.upload(bufs, bucket)
        else:
            bufs = inputs.on_device(bucket)
        timed = self.device.type == "cuda"
        if timed:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        logits = step_fn(*bufs)
        if timed:
            marks[1].record()
        sampled = self._launch_sampling(logits[:n], rows, hashes, sampling)
        if timed:
            marks[2].record()
        tokens, logps = self._read_sampled(sampled, n)
        self.routing.decode(rows)
        stats = self.stats
        if timed:
            stats.device_steps.append((marks[0].elapsed_time(marks[1]) / 1e3, marks[0].elapsed_time(marks[2]) / 1e3))
        stats.decode_steps += 1
        stats.row_steps += n
        stats.useful_row_steps += sum(s.finish_reason is None for s in rows)
        stats.live_kv_tokens += context
        stats.steps.append((n, context, time.perf_counter() - t0))
        for s, t, lp in zip(rows, tokens, logps):
            sched.sampled(s, t, lp, stops)

    def _step_fn(self, rows: int) -> Callable[..., torch.Tensor]:
        if not self.options.cuda_graphs:
            return self._decode_logits
        graph = self._graphs.get(rows)
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = _CapturedDecodeStep(self._decode_logits, rows, self.table_width, self.options.pad_token_id,
                                        self.device, self._graph_pool)
            self._graphs[rows] = graph
        return graph

    def _decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
                       tables: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one decode step: ids/positions [B, 1] int64, lengths int32 [B] = positions + 1,
        tables int32 [B, table_width]."""
        paged = self._paged_decode
        if self._fused is not None:
            pool = self._pool
            pages = tables.gather(1, (positions // PAGE_TOKENS))[:, 0].long()
            hidden = self._fused(ids, positions, pool.keys, pool.values, pages, positions[:, 0] % PAGE_TOKENS,
                                 lambda q, k_pool, v_pool, scale: paged(q, k_pool, v_pool, tables, lengths, scale))
            self.routing.stash(ids.shape[0])
            return self._head(hidden)

        def attend(q, k, v, k_pool, v_pool, scale):
            return paged(q, k_pool, v_pool, tables, lengths, scale)

        kv = KVStep.decode_step(self._pool, positions[:, 0], tables, attend)
        hidden = self._base(input_ids=ids, position_ids=positions, use_cache=False, lockstep_kv=kv).last_hidden_state
        self.routing.stash(ids.shape[0])
        return self._head(hidden[:, -1])


def seed_hashes_of(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    from kernels.sampling import seed_hashes

    return seed_hashes(seed_words(seeds, device))


def sample_tokens(logits: torch.Tensor, sampling: SamplingConfig, keys: torch.Tensor) -> torch.Tensor:
    """Next token (int64 [B]) of every row of `logits` [B, V] under `sampling`; row b draws from the stream
    keyed keys[b] (kernels.sampling defines the streams)."""
    return sample_from_keys(logits, keys, greedy=sampling.greedy, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p)
