"""Batched token sampling with per-sample counter-based random streams (no service imports: a kernel).

The stream of a sample is a pure function of (seed, step, token id), so a
sample's tokens depend only on its seed, the step and its own logits, never on
the batch it sits in or the order of rows. All rows are drawn in one batched
call per step; nothing is stateful.

Stream definition (all arithmetic on unsigned 32-bit integers, mod 2**32):

    fmix32(x):  x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16
    s        = seed mod 2**64;  lo, hi = s & 0xFFFFFFFF, s >> 32
    row_key  = fmix32(fmix32(fmix32(lo ^ 0x243F6A88) ^ hi) ^ (step mod 2**32))
    bits     = fmix32(row_key ^ (token_id * 0x9E3779B1))
    u        = ((bits >> 9) + 0.5) * 2**-23                (fp32, exact: 24 significant bits; in (0, 1))
    gumbel   = -log(-log(u))

(fmix32 is MurmurHash3's finalizer.) The drawn token is
argmax_v(scaled[v] + gumbel[v]) with scaled = the temperature-scaled fp32
logits after top-k / top-p truncation (removed entries are -inf and never win):
the Gumbel-max trick, an exact draw from softmax(scaled) (equivalently the
exponential race argmax p / E with E = -log u). Greedy is argmax of the raw
logits. Ties go to the lowest token id.

On CUDA tensors a Triton kernel computes the noise in registers and reduces
each row to its argmax (one pass over the logits); on CPU the same definition
runs as torch integer ops. Both are row-local, so the invariance above holds on
each; they may differ from each other by an ulp of the log, so CPU and GPU
draws are not promised to be equal.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.sampling.hash import FMIX_C1, FMIX_C2, MASK32, SEED_SALT, TOKEN_MULT

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


# ---------------------------------------------------------------- the stream --


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32): split in 16-bit halves so no product leaves int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & MASK32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, FMIX_C1)
    x = x ^ (x >> 13)
    x = _mul32(x, FMIX_C2)
    return x ^ (x >> 16)


def seed_words(seeds: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 [B, 2]: (low, high) 32-bit words of each seed mod 2**64."""
    words = [((s % 2**64) & MASK32, (s % 2**64) >> 32) for s in seeds]
    return torch.tensor(words, dtype=torch.int64, device=device).reshape(len(words), 2)


def row_keys(words: torch.Tensor, step: int) -> torch.Tensor:
    """int64 [B] in [0, 2**32): the key of every row's stream at `step` (see the module docstring)."""
    return stream_keys(words, step + 1)[step]


def stream_keys(words: torch.Tensor, steps: int) -> torch.Tensor:
    """int64 [steps, B]: every row's key at steps 0..steps-1, in one batch of ops (row t is contiguous), so a
    decode loop launches nothing per step to derive its keys."""
    h = fmix32(words[:, 0] ^ SEED_SALT)
    h = fmix32(h ^ words[:, 1])
    step_ids = torch.arange(steps, dtype=torch.int64, device=words.device) & MASK32
    return fmix32(h[None, :] ^ step_ids[:, None])


def seed_hashes(words: torch.Tensor) -> torch.Tensor:
    """int64 [B] in [0, 2**32): the part of each row's key that depends on its seed alone."""
    return fmix32(fmix32(words[:, 0] ^ SEED_SALT) ^ words[:, 1])


def keys_at(hashes: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """int64 [B]: row b's key at its own step steps[b] (rows at different steps: continuous batching); equal to
    stream_keys(words, T)[steps[b], b]."""
    return fmix32(hashes ^ (steps & MASK32))


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, V] in (0, 1): u of every (row, token) for the given row keys (CPU reference of the stream)."""
    tokens = _mul32(torch.arange(vocab, dtype=torch.int64, device=keys.device), TOKEN_MULT)
    bits = fmix32(keys[:, None] ^ tokens[None, :])
    return ((bits >> 9).to(torch.float32) + 0.5) * (2.0**-23)


def gumbel_argmax_reference(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax(scaled + gumbel) per row, in torch ops: the definition the Triton kernel implements."""
    u = uniforms(keys, scaled.shape[-1])
    return (scaled + (-torch.log(-torch.log(u)))).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, keys: torch.Tensor, *, greedy: bool, temperature: float, top_k: int,
                  top_p: float) -> torch.Tensor:
    """Next token (int64 [B]) of every row of `logits` [B, V]; row b draws from the stream keyed keys[b] (the
    row's key at this step: `row_keys` / `stream_keys`)."""
    if greedy:
        return logits.argmax(dim=-1)
    truncated = top_k > 0 or top_p < 1.0
    if logits.is_cuda:
        from kernels.sampling.triton_kernels import gumbel_argmax

        if not truncated:
            return gumbel_argmax(logits, keys, temperature)
        scaled = truncate_logits(logits.float() / temperature, top_k, top_p)
        return gumbel_argmax(scaled, keys, 1.0)
    scaled = logits.float() / temperature
    if truncated:
        scaled = truncate_logits(scaled, top_k, top_p)
    return gumbel_argmax_reference(scaled, keys)
