"""kernels/moe on a GPU at the Qwen3-30B-A3B layer shape, bf16 (`gpu` marker; CI without a GPU deselects it).

hidden 2048, 128 experts, top-8, expert width 768. (1) the Triton grouped GEMM gives each expert's rows
bi_linear's bits for that expert and a row the same bits whatever other rows (and experts) share the call;
(2) within bf16 tolerance of torch's grouped matmul; (3) routing on CUDA bitwise the same alone, batched and
reversed, ties to the lowest expert; (4) the whole experts block alone == batched == reversed; (5) the block
replays under CUDA graph capture (no host sync inside) with the eager bits; (6) a tiny Qwen3-MoE packed on
these ops gives a sequence's logits and experts the same bits alone and among others; (7) gradients of the
grouped GEMM against plain torch.
"""
from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import bi_linear
from kernels.moe import experts_forward, grouped_linear, route, sort_by_expert
from tests.conftest import require
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise

pytestmark = pytest.mark.gpu

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768


@pytest.fixture(autouse=True)
def _cuda():
    require(torch.cuda.is_available(), "no CUDA device")
    torch.cuda.synchronize()


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _routing(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, EXPERTS, generator=g).argsort(-1)[:, :TOP_K].cuda()


def _weights(seed):
    g = _gen(seed)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * INTER ** -0.5).bfloat16()
    return gate_up, down


@pytest.mark.parametrize("tokens", [1, 7, 300, 2048])
def test_grouped_kernel_is_bi_linear_per_expert_and_row_invariant(tokens):
    gate_up, _ = _weights(0)
    order, counts = sort_by_expert(_routing(tokens, tokens), EXPERTS)
    x = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", generator=_gen(1)).bfloat16()
    y = grouped_linear(x, gate_up, counts, impl="triton")
    ref = grouped_linear(x, gate_up, counts, impl="grouped_mm")
    assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3
    bounds = [0, *torch.cumsum(counts, 0).tolist()]
    for e in counts.nonzero().flatten().tolist()[:12]:
        s, t = bounds[e], bounds[e + 1]
        assert_bitwise(y[s:t], bi_linear(x[s:t], gate_up[e]), f"expert {e}")
        alone = torch.zeros_like(counts)
        alone[e] = t - s
        assert_bitwise(grouped_linear(x[s:t], gate_up, alone, impl="triton"), y[s:t], f"expert {e} alone")
        one = torch.zeros_like(counts)
        one[e] = 1
        assert_bitwise(grouped_linear(x[t - 1:t], gate_up, one, impl="triton"), y[t - 1:t], f"expert {e} last row")


def test_routing_on_cuda_is_batch_invariant_and_breaks_ties_low():
    logits = torch.randn(4096, EXPERTS, device="cuda", generator=_gen(2)).bfloat16()
    logits[7, 90] = logits[7, 12] = logits[7].max() + 1
    weights, experts = route(logits, TOP_K, True)
    assert experts[7, :2].tolist() == [12, 90]
    for rows in ([7], [7, 4000, 3], list(range(4095, -1, -1))):
        w, e = route(logits[rows], TOP_K, True)
        assert torch.equal(e, experts[rows])
        assert_bitwise(w, weights[rows], "routing weights")


def _block_inputs(tokens, seed):
    h = torch.randn(tokens, HIDDEN, device="cuda", generator=_gen(seed)).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=_gen(seed + 1))
    weights, experts = route(logits, TOP_K, True)
    return h, experts, weights.bfloat16()


def test_experts_block_alone_equals_batched_and_reversed():
    gate_up, down = _weights(3)
    h, e, w = _block_inputs(512, 4)
    act = torch.nn.functional.silu
    full = experts_forward(h, e, w, gate_up, down, act)
    for rows in ([9], [9, 500], list(range(511, -1, -1)), [9] * 64):
        assert_bitwise(experts_forward(h[rows], e[rows], w[rows], gate_up, down, act), full[rows], f"rows {rows[:3]}")
    fast = experts_forward(h, e, w, gate_up, down, act, impl="grouped_mm")
    assert ((fast.float() - full.float()).norm() / full.float().norm()).item() < 1e-2


def test_experts_block_replays_under_cuda_graph_capture():
    gate_up, down = _weights(5)
    h, e, w = _block_inputs(256, 6)
    act = torch.nn.functional.silu
    static = [t.clone() for t in (h, e, w)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_forward(*static, gate_up, down, act)  # warm-up: compiles the kernel
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward(*static, gate_up, down, act)
    h2, e2, w2 = _block_inputs(256, 7)  # other tokens, other routing
    for dst, src in zip(static, (h2, e2, w2)):
        dst.copy_(src)
    graph.replay()
    assert_bitwise(out, experts_forward(h2, e2, w2, gate_up, down, act), "graph replay vs eager")


def test_tiny_qwen3_moe_on_cuda_is_batch_invariant():
    from kernels.attention import REGISTRY, register_hf_attention
    from kernels.attention.hf import packed_forward_kwargs
    from kernels.batch_invariant.hf import make_batch_invariant
    from kernels.moe.hf_blocks import router_states
    from recipes.tiny_moe import TinyMoeConfig, build_tiny_moe

    for family in ("qwen3_moe", "qwen2_moe"):
        model = make_batch_invariant(build_tiny_moe(TinyMoeConfig(family=family), seed=0).cuda().bfloat16())
        model.set_attn_implementation(register_hf_attention())
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, model.config.vocab_size, (n,), generator=g).cuda() for n in (7, 70, 3, 130)]

        def packed(batch):
            ids = torch.cat(batch)
            positions = torch.cat([torch.arange(len(s)) for s in batch]).cuda()
            cu = torch.tensor([0, *torch.tensor([len(s) for s in batch]).cumsum(0).tolist()], dtype=torch.int32).cuda()
            with torch.no_grad(), REGISTRY.forced("batch_invariant"):
                out = model(input_ids=ids[None], use_cache=False,
                            **packed_forward_kwargs(positions, cu, max(map(len, batch))))
            return out.logits[0], torch.stack([s.experts for s in router_states(model)])

        alone = packed([seqs[1]])
        for batch in (seqs, list(reversed(seqs))):
            logits, experts = packed(batch)
            start = sum(len(s) for s in batch[:next(i for i, s in enumerate(batch) if s is seqs[1])])
            assert torch.equal(logits[start:start + 70], alone[0])
            assert torch.equal(experts[:, start:start + 70], alone[1])


def test_grouped_gemm_gradients_against_plain_torch():
    gate_up, _ = _weights(8)
    w = gate_up[:16].float().requires_grad_()
    counts = torch.tensor([5, 0, 40, 3] + [2] * 12, device="cuda")
    x = torch.randn(int(counts.sum()), HIDDEN, device="cuda", generator=_gen(9)).requires_grad_()
    up = torch.randn(x.shape[0], 2 * INTER, device="cuda", generator=_gen(10))
    (grouped_linear(x.bfloat16(), w.bfloat16(), counts) .float() * up).sum().backward()
    experts = torch.repeat_interleave(torch.arange(16, device="cuda"), counts)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.einsum("mk,mnk->mn", x2, w2[experts]) * up).sum().backward()
    for a, b in ((x.grad, x2.grad), (w.grad, w2.grad)):
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))
