"""kernels/moe on CPU: routing's tie rule and fixed order, the grouped GEMM against bi_linear, the experts'
combination, and each token's bits alone == batched == reversed. The interpreted Triton kernel is in
test_moe_triton.py; the same properties on CUDA in test_moe_gpu.py."""
from __future__ import annotations

import pytest
import torch

from kernels.batch_invariant import bi_linear
from kernels.batch_invariant.errors import BatchInvariantInputError
from kernels.moe import RoutingInputError, experts_forward, grouped_linear, route, top_k_lowest_index
from kernels.moe.grouped import reference as grouped_reference
from kernels.moe.routing import fixed_order_sum, router_probabilities
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_top_k_breaks_exact_ties_by_the_lowest_expert_index():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.3, 0.1],     # tie for first: 2 before 3
                          [0.4, 0.1, 0.1, 0.1, 0.3],     # tie for second among 1, 2, 3: 1
                          [0.2, 0.2, 0.2, 0.2, 0.2]])    # all tied: 0 then 1
    values, experts = top_k_lowest_index(probs, 2)
    assert experts.tolist() == [[2, 3], [0, 4], [0, 1]]
    values, experts = top_k_lowest_index(probs[1:2], 3)
    assert experts.tolist() == [[0, 4, 1]]
    assert torch.equal(values, probs[1:2, [0, 4, 1]])
    # The rule holds at every position of the tie and whatever the row's neighbours.
    for perm in ([1, 0, 2], [2, 1, 0]):
        assert torch.equal(top_k_lowest_index(probs[perm], 2)[1], experts_of(probs, 2)[perm])


def experts_of(probs, k):
    return top_k_lowest_index(probs, k)[1]


def test_route_from_equal_logits_picks_the_lower_expert_and_renormalises():
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0, 0.0, 2.0, -3.0]])
    weights, experts = route(logits, 2, norm_topk_prob=True)
    assert experts.tolist() == [[1, 3]]
    assert torch.equal(weights, torch.tensor([[0.5, 0.5]]))
    weights, experts = route(logits, 3, norm_topk_prob=False)
    assert experts.tolist() == [[1, 3, 6]]
    assert torch.equal(weights, router_probabilities(logits)[:, [1, 3, 6]])


def test_route_agrees_with_hugging_faces_router_without_ties():
    g = _gen(0)
    logits = torch.randn(300, 16, generator=g)
    for norm in (True, False):
        weights, experts = route(logits, 4, norm)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        want_w, want_e = torch.topk(probs, 4, dim=-1)
        if norm:
            want_w = want_w / want_w.sum(-1, keepdim=True)
        assert torch.equal(experts, want_e)
        torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_fixed_order_sum_is_a_pairwise_tree():
    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0]])
    # ((1e8 + 1) + (-1e8 + 1)) + (3 + 0): fp32 rounds both inner sums to +-1e8, so the tree gives 3 where
    # a left-to-right sum gives 4. The order is the code's, whatever the shape of the tensor around the row.
    assert fixed_order_sum(x).tolist() == [[3.0]]
    assert fixed_order_sum(x.expand(7, 5).contiguous()).tolist() == [[3.0]] * 7


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tokens_routing_does_not_depend_on_the_batch(dtype):
    g = _gen(1)
    logits = torch.randn(257, 128, generator=g).to(dtype)
    weights, experts = route(logits, 8, True)
    for rows in ([5], [5, 0, 200], list(range(256, -1, -1)), [5] * 33):
        w, e = route(logits[rows], 8, True)
        assert torch.equal(e, experts[rows])
        assert_bitwise(w, weights[rows], f"weights of rows {rows[:4]}")


def test_forced_experts_are_used_and_checked():
    logits = torch.randn(3, 8, generator=_gen(2))
    forced = torch.tensor([[7, 0], [1, 2], [3, 4]])
    weights, experts = route(logits, 2, False, forced=forced)
    assert torch.equal(experts, forced)
    assert torch.equal(weights, router_probabilities(logits).gather(-1, forced))
    for bad, what in ((torch.tensor([[8, 0], [1, 2], [3, 4]]), "lie in"), (torch.tensor([[0], [1], [2]]), "expected"),
                      (torch.tensor([[1, 1], [1, 2], [3, 4]]), "twice"), (torch.tensor([[-1, 0], [1, 2], [3, 4]]), "lie in")):
        with pytest.raises(RoutingInputError, match=what):
            route(logits, 2, False, forced=bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_reference_gives_each_expert_bi_linears_bits(dtype):
    g = _gen(3)
    counts = torch.tensor([3, 0, 17, 1, 9, 0])
    x = torch.randn(int(counts.sum()), 40, generator=g).to(dtype)
    w = (torch.randn(6, 24, 40, generator=g) / 6).to(dtype)
    y = grouped_linear(x, w, counts)
    assert y.dtype == dtype and y.shape == (30, 24)
    start = 0
    for e, c in enumerate(counts.tolist()):
        assert_bitwise(y[start:start + c], bi_linear(x[start:start + c], w[e], impl="reference"), f"expert {e}")
        start += c
    torch.testing.assert_close(grouped_linear(x, w, counts, impl="grouped_mm").float(), y.float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_grouped_linear_refuses_bad_arguments():
    x, w = torch.randn(4, 8), torch.randn(2, 6, 8)
    with pytest.raises(BatchInvariantInputError, match="counts"):
        grouped_linear(x, w, torch.tensor([4]))
    with pytest.raises(BatchInvariantInputError, match="K"):
        grouped_linear(torch.randn(4, 7), w, torch.tensor([2, 2]))
    with pytest.raises(BatchInvariantInputError, match="impl"):
        grouped_linear(x, w, torch.tensor([2, 2]), impl="cublas")
    with pytest.raises(BatchInvariantInputError, match="dtype"):
        grouped_linear(x.bfloat16(), w, torch.tensor([2, 2]))


def test_grouped_linear_backward_matches_autograd_of_the_plain_math():
    g = _gen(4)
    counts = torch.tensor([2, 0, 5, 3])
    x = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 8, 16, generator=g, requires_grad=True)
    upstream = torch.randn(10, 8, generator=g)
    (grouped_linear(x, w, counts) * upstream).sum().backward()
    experts = torch.repeat_interleave(torch.arange(4), counts)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (torch.einsum("mk,mnk->mn", x2, w2[experts]) * upstream).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))


def _experts_inputs(dtype, tokens=40, n_experts=8, k=2, hidden=32, inter=16, seed=5):
    g = _gen(seed)
    hidden_states = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, n_experts, generator=g)
    weights, experts = route(logits, k, True)
    gate_up = (torch.randn(n_experts, 2 * inter, hidden, generator=g) / 5).to(dtype)
    down = (torch.randn(n_experts, hidden, inter, generator=g) / 4).to(dtype)
    return hidden_states, experts, weights.to(dtype), gate_up, down


@pytest.mark.parametrize("dtype", DTYPES)
def test_experts_output_of_a_token_is_the_same_alone_batched_and_reversed(dtype):
    h, e, w, gate_up, down = _experts_inputs(dtype)
    act = torch.nn.functional.silu
    full = experts_forward(h, e, w, gate_up, down, act)
    for rows in ([7], [7, 3], list(range(39, -1, -1)), [7] * 9 + [0]):
        got = experts_forward(h[rows], e[rows], w[rows], gate_up, down, act)
        assert_bitwise(got, full[rows], f"tokens {rows[:4]}")


def test_a_call_with_no_tokens_returns_an_empty_output():
    # A data-parallel rank or a prefill chunk can hold no tokens for a layer's experts.
    h, e, w, gate_up, down = _experts_inputs(torch.float32)
    got = experts_forward(h[:0], e[:0], w[:0], gate_up, down, torch.nn.functional.silu)
    assert got.shape == (0, h.shape[1]) and got.dtype == h.dtype


def test_experts_forward_is_hugging_faces_expert_math():
    h, e, w, gate_up, down = _experts_inputs(torch.float32)
    want = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for r in range(e.shape[1]):
            gate, up = (h[t] @ gate_up[e[t, r]].T).chunk(2)
            want[t] += w[t, r] * ((torch.nn.functional.silu(gate) * up) @ down[e[t, r]].T)
    got = experts_forward(h, e, w, gate_up, down, torch.nn.functional.silu)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The fast path (torch's grouped matmul) computes the same function.
    fast = experts_forward(h, e, w, gate_up, down, torch.nn.functional.silu, impl="grouped_mm")
    torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-6)


def test_grouped_reference_is_the_reference_even_on_large_columns():
    # More columns than one PRODUCT_BUDGET step: the column split must not change a row's bits.
    g = _gen(6)
    counts = torch.tensor([1, 2])
    x = torch.randn(3, 4096, generator=g)
    w = torch.randn(2, 96, 4096, generator=g)
    y = grouped_reference(x, w, counts)
    assert_bitwise(y[1:], bi_linear(x[1:], w[1], impl="reference"), "expert 1")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,width", [(torch.sigmoid, 1), (torch.exp, 8), (torch.nn.functional.silu, 16),
                                      (torch.exp, 70)])
def test_rowwise_gives_a_row_its_bits_wherever_it_sits(fn, width, dtype):
    from kernels.moe.rowwise import rowwise

    x = torch.randn(1500, width, generator=_gen(7)).to(dtype)  # more than one slab at the padded width
    full = rowwise(fn, x)
    torch.testing.assert_close(full.float(), fn(x).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    for rows in ([1499], [0], list(range(37)), list(range(1499, 700, -1))):
        assert_bitwise(rowwise(fn, x[rows]), full[rows], f"{fn.__name__} rows {rows[:3]}")
