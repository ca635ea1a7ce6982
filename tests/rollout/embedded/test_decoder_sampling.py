"""The decoder's counter-based sampler: the stream definition, row independence, exactness, the Triton kernel."""
from __future__ import annotations

import pytest
import torch

from kernels.sampling import (
    FMIX_C1,
    FMIX_C2,
    MASK32,
    SEED_SALT,
    TOKEN_MULT,
    row_keys,
    seed_words,
    stream_keys,
    uniforms,
)
from services.rollout.embedded.decoder import sample_tokens
from services.rollout.types import SamplingConfig

CPU = torch.device("cpu")


def py_fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * FMIX_C1) & MASK32
    x ^= x >> 13
    x = (x * FMIX_C2) & MASK32
    return x ^ (x >> 16)


def py_uniform(seed: int, step: int, token: int) -> float:
    """The module docstring's stream definition, in plain Python integers."""
    s = seed % 2**64
    key = py_fmix32(py_fmix32(py_fmix32((s & MASK32) ^ SEED_SALT) ^ (s >> 32)) ^ (step & MASK32))
    bits = py_fmix32(key ^ ((token * TOKEN_MULT) & MASK32))
    return ((bits >> 9) + 0.5) * 2.0**-23


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**40 + 3, 2**63 + 5, -7])
def test_stream_matches_its_definition(seed):
    keys = row_keys(seed_words([seed], CPU), 17)
    u = uniforms(keys, 300)[0]
    for token in (0, 1, 2, 150, 299):
        assert u[token].item() == py_uniform(seed, 17, token)


def test_all_steps_keys_at_once_equal_each_steps_key():
    words = seed_words([3, 2**50, -1], CPU)
    table = stream_keys(words, 40)
    assert table.shape == (40, 3) and table[7].is_contiguous()
    assert all(torch.equal(table[t], row_keys(words, t)) for t in (0, 1, 7, 39))


def test_uniforms_look_uniform_and_streams_differ():
    keys = row_keys(seed_words(list(range(64)), CPU), 3)
    u = uniforms(keys, 4096)
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.002 and abs(u.var().item() - 1 / 12) < 0.001
    # Neighbouring seeds and steps give unrelated streams.
    corr = torch.corrcoef(u[:8])
    assert (corr - torch.eye(8)).abs().max() < 0.06
    other_step = uniforms(row_keys(seed_words(list(range(64)), CPU), 4), 4096)
    assert (u == other_step).float().mean() < 0.01


def test_a_rows_draw_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 2
    seeds = [5, 6, 7, 8, 9, 10]
    cfg = SamplingConfig(temperature=0.9, top_k=20, top_p=0.9)
    together = sample_tokens(logits, cfg, row_keys(seed_words(seeds, CPU), 4))
    for b in range(6):
        alone = sample_tokens(logits[b:b + 1], cfg, row_keys(seed_words([seeds[b]], CPU), 4))
        assert alone.item() == together[b].item()
    reordered = sample_tokens(logits.flip(0), cfg, row_keys(seed_words(seeds[::-1], CPU), 4))
    assert reordered.flip(0).tolist() == together.tolist()


def test_draws_follow_the_distribution():
    """Over many seeds, token frequencies match softmax(logits / T) (Gumbel-max is an exact sampler)."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, temperature = 20000, 0.8
    draws = sample_tokens(logits.expand(n, -1), SamplingConfig(temperature=temperature),
                          row_keys(seed_words(range(n), CPU), 0))
    freq = torch.bincount(draws, minlength=6).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    # 5 standard errors per token.
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all(), (freq, p)


def test_truncated_tokens_are_never_drawn_and_greedy_is_argmax():
    logits = torch.tensor([[3.0, 2.9, 2.8, -1.0, 0.0, 1.0]]).expand(512, -1)
    keys = row_keys(seed_words(range(512), CPU), 1)
    top2 = sample_tokens(logits, SamplingConfig(temperature=2.0, top_k=2), keys)
    assert set(top2.tolist()) == {0, 1}
    assert sample_tokens(logits, SamplingConfig(greedy=True), keys).tolist() == [0] * 512


def test_triton_kernel_matches_the_torch_definition():
    """The CUDA sampler kernel (run interpreted on CPU) draws what the torch reference draws."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")  # tests/conftest.py sets it on CPU hosts
    from kernels.sampling import gumbel_argmax_reference
    from kernels.sampling.triton_kernels import gumbel_argmax

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1)
    logits = (torch.randn(7, 5000) * 3).to(device)
    keys = row_keys(seed_words([3, 1, 4, 1, 5, 9, 2], torch.device(device)), 11)
    want = gumbel_argmax_reference(logits.float() / 0.7, keys)
    got = gumbel_argmax(logits, keys, 0.7)
    assert got.tolist() == want.tolist()
    # -inf entries (truncation) never win, even with the largest noise.
    masked = logits.clone()
    masked[:, want] = float("-inf")
    assert not (gumbel_argmax(masked, keys, 1.0) == want).any()
