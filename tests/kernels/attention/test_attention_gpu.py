"""GPU backends against the reference (run on the device machine; CI deselects `gpu`).

Tolerances (bf16/fp16 inputs; the reference computes in fp32 from the same inputs):
relative Frobenius error ||out - ref|| / ||ref|| <= 1e-2 for outputs and input gradients
(bf16 rounding of the output alone is ~3e-3). HF end to end in bf16: the packed model through
the backend vs the same weights one sequence at a time through HF's SDPA must pass the
step-1 parity gate's default thresholds.
"""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.attention import REGISTRY, PackedLayout, packed_causal_attention, packed_forward_kwargs, \
    register_hf_attention
from tests.conftest import require

pytestmark = pytest.mark.gpu

LENGTHS = [1, 7, 300, 1024, 33, 2000, 2, 129]


def _need(backend: str) -> None:
    require(torch.cuda.is_available(), "no CUDA device")
    reason = REGISTRY.get(backend).unavailable_reason("cuda")
    require(reason is None, f"{backend}: {reason}")


def _inputs(lengths, hq=8, hkv=2, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, device="cuda", dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    go = torch.randn(T, hq, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, go


def _fwd_bwd(backend, q, k, v, go, lay, window=None, upcast=False):
    leaves = [x.detach().clone().float() if upcast else x.detach().clone() for x in (q, k, v)]
    for x in leaves:
        x.requires_grad_()
    with REGISTRY.forced(backend):
        out = packed_causal_attention(*leaves, lay.cu_seqlens, lay.max_seqlen, window=window)
    out.backward(go.float() if upcast else go)
    return out.detach().float(), [x.grad.float() for x in leaves]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


SHAPES = [(8, 2, 128, None), (4, 4, 64, None), (8, 1, 128, 256)]  # (Hq, Hkv, D, window): GQA, MHA, MQA+window
CASES = [(b, dt, *shape) for b in ("torch_varlen", "flash_attn") for dt in (torch.bfloat16, torch.float16)
         for shape in SHAPES]
# flex compiles a kernel per (dtype, heads, mask) combination (tens of seconds each): bf16, two shapes.
CASES += [("flex", torch.bfloat16, *SHAPES[0]), ("flex", torch.bfloat16, *SHAPES[2])]


@pytest.mark.parametrize("backend, dtype, hq, hkv, d, window", CASES)
def test_backend_matches_reference(backend, dtype, hq, hkv, d, window):
    _need(backend)
    q, k, v, go = _inputs(LENGTHS, hq, hkv, d, dtype)
    lay = PackedLayout.from_lengths(LENGTHS, "cuda")
    out, grads = _fwd_bwd(backend, q, k, v, go, lay, window)
    ref, ref_grads = _fwd_bwd("reference", q, k, v, go, lay, window, upcast=True)
    assert torch.isfinite(out).all()
    errs = [_rel(out, ref)] + [_rel(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errs) <= 1e-2, f"{backend} rel errors out/dq/dk/dv = {errs}"


def test_boundaries_matter_on_gpu():
    """A check on the check: packing two sequences and ignoring the boundary changes the second one."""
    _need("torch_varlen")
    q, k, v, go = _inputs([300, 300])
    two = PackedLayout.from_lengths([300, 300], "cuda")
    one = PackedLayout.from_lengths([600], "cuda")
    with REGISTRY.forced("torch_varlen"):
        a = packed_causal_attention(q, k, v, two.cu_seqlens, two.max_seqlen)
        b = packed_causal_attention(q, k, v, one.cu_seqlens, one.max_seqlen)
    assert torch.equal(a[:300], b[:300]) and _rel(a[300:].float(), b[300:].float()) > 0.1


def test_auto_selection_on_cuda_prefers_a_varlen_kernel():
    require(torch.cuda.is_available(), "no CUDA device")
    pick = REGISTRY.select(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128, packed=True,
                           window=None)
    assert pick.name in ("flash_attn", "torch_varlen")


def test_torch_varlen_is_bitwise_reproducible_under_deterministic_algorithms():
    _need("torch_varlen")
    q, k, v, go = _inputs(LENGTHS, seed=3)
    lay = PackedLayout.from_lengths(LENGTHS, "cuda")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert REGISTRY.select(device=q.device, dtype=q.dtype, head_dim=128, packed=True,
                               window=None).name in ("flash_attn", "torch_varlen")
        runs = [_fwd_bwd("torch_varlen", q, k, v, go, lay) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    for out, grads in runs[1:]:
        assert torch.equal(out, runs[0][0])
        assert all(torch.equal(g, r) for g, r in zip(grads, runs[0][1]))


@pytest.mark.parametrize("backend", ["torch_varlen", "flex"])
def test_hf_qwen3_bf16_packed_passes_the_parity_gate(backend):
    _need(backend)
    import transformers

    from kernels.logprob import token_logprobs
    from services.trainer.parity_gate import check_parity

    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    engine = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    engine.set_attn_implementation("sdpa")
    trainer = copy.deepcopy(engine)
    trainer.set_attn_implementation(register_hf_attention())
    lengths = [5, 300, 1, 64, 900, 17]
    g = torch.Generator(device="cuda").manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), device="cuda", generator=g) for n in lengths]
    lay = PackedLayout.from_lengths(lengths, "cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    REGISTRY.reset_usage()
    with torch.no_grad(), REGISTRY.forced(backend):
        logits = trainer(input_ids=torch.cat(seqs)[None], **packed_forward_kwargs(pos, lay.cu_seqlens,
                                                                                   lay.max_seqlen)).logits[0]
        singles = [engine(input_ids=s[None]).logits[0] for s in seqs]
    assert REGISTRY.usage() == {backend: 2}
    starts = lay.cu_seqlens[:-1].tolist()
    rows = torch.cat([torch.arange(s, s + n - 1, device="cuda") for s, n in zip(starts, lengths)])
    ids = torch.cat(seqs)
    lp = token_logprobs(logits[rows], ids[rows + 1], backend="reference")[0]
    rl = token_logprobs(torch.cat([x[:-1] for x in singles]), ids[rows + 1], backend="reference")[0]
    seq_of_row = torch.cat([torch.full((n - 1,), i, device="cuda") for i, n in enumerate(lengths)])
    verdict = check_parity(lp, rl, sample_index=seq_of_row, positions=pos[rows] + 1,
                           attention_backend=backend, logprob_backend="reference")
    print(verdict.message())
    assert verdict.passed, verdict.message()
