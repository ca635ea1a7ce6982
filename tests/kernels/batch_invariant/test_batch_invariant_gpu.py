"""The batch-invariant Triton kernels on a GPU at the Qwen3-0.6B shape, bf16 (CI deselects `gpu`).

hidden 1024, 16 query heads over 8 kv heads of 128, intermediate 3072, vocab 151936 (lm_head).
(1) rows bitwise independent of the batch; (2) decode == packed prefill bitwise at every position
(NaN in cache tails); (3) within tolerance of fp32 torch; (4) gradients against plain torch;
HF's rotary embedding row-invariant on the GPU; the kernels under CUDA graph capture; a tiny HF
Qwen3 packed on these ops equals each sequence alone; and bi_linear's speed against torch
(printed, not asserted: run with -s to see it).

Tolerances (bf16 inputs, fp32 references from the same inputs): relative Frobenius error
||out - ref|| / ||ref|| <= 4e-3 for matmul and RMSNorm (bf16 rounding of the output alone is
~1.1e-3) and <= 1e-2 for attention outputs and all gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.batch_invariant import KEY_BLOCK, bi_linear, bi_rms_norm, decode_attention, packed_attention
from tests.conftest import require
from tests.kernels.batch_invariant.batch_invariant_support import (
    ROW_COUNTS,
    assert_bitwise,
    check_rotary_row_invariance,
    pack_lengths,
    sdpa_packed,
)

pytestmark = pytest.mark.gpu

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 1024, 16, 8, 128, 3072, 151936
# (K, N) of every projection: q, k/v, o, gate/up, down, lm_head.
LINEAR_SHAPES = [(HIDDEN, HEADS * HEAD_DIM), (HIDDEN, KV_HEADS * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
                 (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN), (HIDDEN, VOCAB)]
LENGTHS = [1, 7, 300, 1024, 33, 2000, 2, 129, KEY_BLOCK, KEY_BLOCK + 1]


@pytest.fixture(autouse=True)
def _cuda():
    require(torch.cuda.is_available(), "no CUDA device")
    torch.cuda.synchronize()


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _qkv(total, dtype=torch.bfloat16, seed=0):
    g = _gen(seed)
    return tuple(torch.randn(total, h, HEAD_DIM, device="cuda", generator=g).to(dtype) for h in (HEADS, KV_HEADS,
                                                                                                  KV_HEADS))


# ---- (1) + (3): matmul and RMSNorm --------------------------------------------------------------
@pytest.mark.parametrize("k,n", LINEAR_SHAPES)
def test_linear_rows_are_batch_invariant_and_accurate(k, n):
    g = _gen(1)
    x = torch.randn(4096, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    full = bi_linear(x, w)
    for m in ROW_COUNTS:
        idx = torch.randperm(4096, device="cuda", generator=g)[:m]
        assert_bitwise(bi_linear(x[idx], w), full[idx], f"K={k} N={n} M={m}")
    assert _rel(full, x.float() @ w.float().t()) <= 4e-3


def test_linear_with_bias_and_fp32():
    g = _gen(2)
    x = torch.randn(300, HIDDEN, device="cuda", generator=g)
    w = torch.randn(HIDDEN, HIDDEN, device="cuda", generator=g) / 32
    b = torch.randn(HIDDEN, device="cuda", generator=g)
    for dtype, tol in ((torch.bfloat16, 4e-3), (torch.float32, 1e-5)):
        xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
        full = bi_linear(xd, wd, bd)
        for m in ROW_COUNTS:
            assert_bitwise(bi_linear(xd[:m], wd, bd), full[:m], f"{dtype} bias M={m}")
        assert _rel(full, xd.double() @ wd.double().t() + bd.double()) <= tol


@pytest.mark.parametrize("hidden", [HIDDEN, HEAD_DIM])
def test_rms_norm_rows_are_batch_invariant_and_accurate(hidden):
    g = _gen(3)
    x = (torch.randn(4096, hidden, device="cuda", generator=g) * 3).bfloat16()
    w = (1 + torch.randn(hidden, device="cuda", generator=g) / 10).bfloat16()
    full = bi_rms_norm(x, w, 1e-6)
    for m in ROW_COUNTS:
        idx = torch.randperm(4096, device="cuda", generator=g)[:m]
        assert_bitwise(bi_rms_norm(x[idx], w, 1e-6), full[idx], f"H={hidden} M={m}")
    xf = x.float()
    hf = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert _rel(full, hf) <= 4e-3


# ---- (1) + (3): attention ---------------------------------------------------------------------
def test_packed_attention_sequences_are_pack_invariant_and_accurate():
    q, k, v = _qkv(sum(LENGTHS), seed=4)
    cu = pack_lengths(LENGTHS, "cuda")
    scale = HEAD_DIM ** -0.5
    full = packed_attention(q, k, v, cu, max(LENGTHS), scale)
    assert _rel(full, sdpa_packed(q.float(), k.float(), v.float(), cu, scale)) <= 1e-2
    starts = cu.tolist()
    g = torch.Generator().manual_seed(4)
    for n in (1, 3, 5):
        chosen = torch.randperm(len(LENGTHS), generator=g)[:n].tolist()
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in chosen]).cuda()
        sub = [LENGTHS[i] for i in chosen]
        out = packed_attention(q[rows], k[rows], v[rows], pack_lengths(sub, "cuda"), max(sub), scale)
        assert_bitwise(out, full[rows], f"sequences {chosen}")


def _decode_rows(k, v, lengths, cap, fill):
    """Cache row i holds token i's sequence up to and including token i, `fill` beyond (see the CPU helper)."""
    total = k.shape[0]
    kc = torch.full((total, KV_HEADS, cap, HEAD_DIM), fill, dtype=k.dtype, device="cuda")
    vc = torch.full_like(kc, fill)
    lens = torch.empty(total, dtype=torch.int32)
    start = 0
    for length in lengths:
        for t in range(length):
            kc[start + t, :, : t + 1] = k[start:start + t + 1].transpose(0, 1)
            vc[start + t, :, : t + 1] = v[start:start + t + 1].transpose(0, 1)
            lens[start + t] = t + 1
        start += length
    return kc, vc, lens.cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_equals_packed_prefill_at_every_position(dtype):
    lengths = [1, KEY_BLOCK - 1, KEY_BLOCK, KEY_BLOCK + 1, 300, 1000] if dtype == torch.bfloat16 else [1, 65, 200]
    q, k, v = _qkv(sum(lengths), dtype, seed=5)
    scale = HEAD_DIM ** -0.5
    packed = packed_attention(q, k, v, pack_lengths(lengths, "cuda"), max(lengths), scale)
    kc, vc, lens = _decode_rows(k, v, lengths, cap=1024, fill=float("nan"))
    decoded = decode_attention(q, kc, vc, lens, scale)
    assert not decoded.isnan().any()
    assert_bitwise(decoded, packed, f"{dtype} decode row vs packed row")
    # (1) for decode: a row's bits do not depend on the other rows of the step.
    g = torch.Generator().manual_seed(5)
    for m in ROW_COUNTS:
        idx = torch.randperm(q.shape[0], generator=g)[:m].cuda()
        assert_bitwise(decode_attention(q[idx], kc[idx], vc[idx], lens[idx], scale), decoded[idx], f"decode M={m}")


# ---- (4) autograd ----------------------------------------------------------------------------------
def test_gradients_match_plain_torch():
    g = _gen(6)
    x = torch.randn(2, 333, HIDDEN, device="cuda", generator=g).bfloat16()
    w = (torch.randn(INTERMEDIATE, HIDDEN, device="cuda", generator=g) / 32).bfloat16()
    nw = (1 + torch.randn(HIDDEN, device="cuda", generator=g) / 10).bfloat16()

    def grads(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        out.backward(torch.randn(out.shape, device="cuda", generator=_gen(7)).to(out.dtype))
        return [t.grad.float() for t in leaves]

    for got, want in zip(grads(bi_linear, x, w), grads(F.linear, x, w)):
        assert _rel(got, want) <= 1e-2

    def hf_norm(t, weight):
        tf = t.float()
        return weight * (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype)

    for got, want in zip(grads(lambda t, wt: bi_rms_norm(t, wt, 1e-6), x, nw), grads(hf_norm, x, nw)):
        assert _rel(got, want) <= 1e-2

    lengths = [5, 300, 1, 700]
    q, k, v = _qkv(sum(lengths), seed=8)
    cu = pack_lengths(lengths, "cuda")
    scale = HEAD_DIM ** -0.5
    got = grads(lambda a, b, c: packed_attention(a, b, c, cu, max(lengths), scale), q, k, v)
    want = grads(lambda a, b, c: sdpa_packed(a.float(), b.float(), c.float(), cu, scale), q, k, v)
    for a, b in zip(got, want):
        assert _rel(a, b) <= 1e-2


# ---- rotary, graph capture, HF end to end -------------------------------------------------------
def test_hf_rotary_embedding_is_row_invariant_on_gpu():
    check_rotary_row_invariance("cuda")


def test_kernels_replay_under_cuda_graph_capture():
    """The decoder captures its step: no host sync in the ops, and a replay gives the eager bits."""
    g = _gen(9)
    b, cap = 48, 512
    x = torch.randn(b, HIDDEN, device="cuda", generator=g).bfloat16()
    w = (torch.randn(HEADS * HEAD_DIM, HIDDEN, device="cuda", generator=g) / 32).bfloat16()
    nw = torch.randn(HIDDEN, device="cuda", generator=g).bfloat16()
    kc = torch.randn(b, KV_HEADS, cap, HEAD_DIM, device="cuda", generator=g).bfloat16()
    vc = torch.randn_like(kc)
    lens = torch.randint(1, cap + 1, (b,), device="cuda", generator=g, dtype=torch.int32)

    def step():
        h = bi_rms_norm(x, nw, 1e-6)
        q = bi_linear(h, w).view(b, HEADS, HEAD_DIM)
        return decode_attention(q, kc, vc, lens, HEAD_DIM ** -0.5)

    with torch.no_grad():
        eager = step()  # compiles the kernels outside capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        lens.copy_(torch.randint(1, cap + 1, (b,), device="cuda", generator=g, dtype=torch.int32))
        expected = step()
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(captured, expected, "graph replay vs eager after new lengths")
    assert not torch.equal(eager, expected)


def test_packed_hf_qwen3_on_batch_invariant_ops_equals_each_sequence_alone_on_gpu():
    transformers = pytest.importorskip("transformers")
    from kernels.attention import REGISTRY, PackedLayout, packed_forward_kwargs, register_hf_attention

    cfg = transformers.Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    norm_cls = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda t, m=module: bi_linear(t, m.weight, m.bias)
        elif isinstance(module, norm_cls):
            module.forward = lambda t, m=module: bi_rms_norm(t, m.weight, m.variance_epsilon)
    model.set_attn_implementation(register_hf_attention())
    lengths = [1, 9, 200, 64, 513]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 512, (n,), generator=g).cuda() for n in lengths]

    def forward(ids, sizes):
        lay = PackedLayout.from_lengths(sizes, "cuda")
        pos = torch.cat([torch.arange(n) for n in sizes]).cuda()
        return model(input_ids=ids[None], **packed_forward_kwargs(pos, lay.cu_seqlens, lay.max_seqlen)).logits[0]

    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        packed = forward(torch.cat(seqs), lengths)
        start = 0
        for s in seqs:
            assert_bitwise(packed[start:start + s.numel()], forward(s, [s.numel()]), f"sequence of {s.numel()}")
            start += s.numel()


# ---- speed (printed) ------------------------------------------------------------------------------
def _time_ms(fn, iters=20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def test_print_bi_linear_speed_against_torch():
    g = _gen(10)
    rows = []
    for m, k, n in ((8192, HIDDEN, INTERMEDIATE), (8192, INTERMEDIATE, HIDDEN), (8192, HIDDEN, VOCAB),
                    (256, HIDDEN, HEADS * HEAD_DIM), (256, HEADS * HEAD_DIM, HIDDEN), (256, INTERMEDIATE, HIDDEN),
                    (256, HIDDEN, VOCAB)):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = (torch.randn(n, k, device="cuda", generator=g) / 32).bfloat16()
        with torch.no_grad():
            ours = _time_ms(lambda: bi_linear(x, w))
            theirs = _time_ms(lambda: F.linear(x, w))
        tflops = 2 * m * n * k / ours / 1e9
        rows.append(f"  M={m:5d} K={k:5d} N={n:6d}: bi_linear {ours:7.3f} ms ({tflops:6.1f} TFLOP/s), "
                    f"torch {theirs:7.3f} ms, ratio {ours / theirs:5.2f}x")
    lengths = [2048] * 8
    q, k, v = _qkv(sum(lengths), seed=11)
    cu = pack_lengths(lengths, "cuda")
    with torch.no_grad():
        ours = _time_ms(lambda: packed_attention(q, k, v, cu, 2048, HEAD_DIM ** -0.5), iters=5)
        theirs = _time_ms(lambda: sdpa_packed(q, k, v, cu, HEAD_DIM ** -0.5), iters=5)
    rows.append(f"  packed attention 8 x 2048: {ours:.3f} ms, per-sequence SDPA {theirs:.3f} ms")
    b, cap = 256, 1024
    kc = torch.randn(b, KV_HEADS, cap, HEAD_DIM, device="cuda", generator=g).bfloat16()
    qd = torch.randn(b, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    lens = torch.full((b,), 768, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        ours = _time_ms(lambda: decode_attention(qd, kc, kc, lens, HEAD_DIM ** -0.5))
    kv_bytes = 2 * b * KV_HEADS * 768 * HEAD_DIM * 2
    rows.append(f"  decode attention B=256 L=768: {ours:.3f} ms ({kv_bytes / ours / 1e6:.0f} GB/s of KV read)")
    print("\nbatch-invariant kernels vs torch (bf16):\n" + "\n".join(rows))
