"""kernels/moe/fast_experts.py on CPU: `fast` mode's experts compute Hugging Face's function and its gradients,
the hand-written backward of the token movement equals autograd's, the same inputs give the same bits, and
observe_routing binds it to every experts module of both covered families (refusing another layout)."""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.moe import route
from kernels.moe.fast_experts import fast_experts_forward, inverse_permutation
from kernels.moe.hf_blocks import fast_experts_module_forward, observe_routing
from recipes.tiny_moe import TinyMoeConfig, build_tiny_moe

SILU = torch.nn.functional.silu


def _inputs(tokens=40, n_experts=8, k=2, hidden=32, inter=16, seed=5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weights, experts = route(torch.randn(tokens, n_experts, generator=g), k, True)
    return (torch.randn(tokens, hidden, generator=g).to(dtype), experts, weights.to(dtype),
            (torch.randn(n_experts, 2 * inter, hidden, generator=g) / 5).to(dtype),
            (torch.randn(n_experts, hidden, inter, generator=g) / 4).to(dtype))


def _plain_math(hidden, experts, weights, gate_up, down):
    """Each token through each of its experts, one at a time, with autograd's own indexing."""
    tokens, k = experts.shape
    out = []
    for t in range(tokens):
        acc = 0
        for r in range(k):
            gate, up = (hidden[t] @ gate_up[experts[t, r]].T).chunk(2)
            acc = acc + weights[t, r] * ((SILU(gate) * up) @ down[experts[t, r]].T)
        out.append(acc)
    return torch.stack(out)


def test_inverse_permutation_undoes_the_order():
    order = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(50)) and torch.equal(inverse[order], torch.arange(50))


def test_output_and_every_gradient_are_hugging_faces_math():
    hidden, experts, weights, gate_up, down = _inputs()
    leaves = [t.requires_grad_() for t in (hidden, weights, gate_up, down)]
    plain = [t.detach().clone().requires_grad_() for t in leaves]
    upstream = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(9))
    got = fast_experts_forward(hidden, experts, weights, gate_up, down, SILU)
    want = _plain_math(plain[0], experts, *plain[1:])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    # Float32 sums over the hidden width in another order (a batched matmul against per-token dot products):
    # a few ulps of the gradients' magnitude apart.
    for name, a, b in zip(("hidden", "weights", "gate_up_proj", "down_proj"), leaves, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"gradient of {name}: {m}")


def test_a_tokens_input_gradient_is_its_rows_gradients_summed_once_in_float32():
    # bf16: the k row gradients of a token are summed in float32 and rounded once, so the result is the
    # float32 sum of exactly the bf16 row gradients autograd's indexing would scatter.
    hidden, experts, weights, gate_up, down = _inputs(dtype=torch.bfloat16, k=3)
    x = hidden.clone().requires_grad_()
    out = fast_experts_forward(x, experts, weights, gate_up, down, SILU)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out.backward(upstream)
    # The same rows gradients from autograd: differentiate w.r.t. the repeated rows themselves.
    from kernels.moe.experts import expert_mlp, sort_by_expert
    order, counts = sort_by_expert(experts, gate_up.shape[0])
    rows = hidden[order // 3].clone().requires_grad_()
    out_sorted = expert_mlp(rows, gate_up, down, counts, SILU, impl="grouped_mm")
    per_pair = out_sorted[inverse_permutation(order)].view(-1, 3, hidden.shape[1])
    torch.bmm(weights.unsqueeze(1), per_pair).view_as(out).backward(upstream)
    want = torch.zeros(hidden.shape, dtype=torch.float32).index_add_(0, order // 3, rows.grad.float())
    assert torch.equal(x.grad, want.to(torch.bfloat16))


def test_the_same_inputs_give_the_same_bits():
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() if t.is_floating_point() else t for t in _inputs(dtype=torch.bfloat16)]
        out = fast_experts_forward(*leaves[:5], SILU)
        out.float().square().sum().backward()
        runs.append([out.detach()] + [t.grad for t in leaves if t.is_floating_point()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_call_with_no_tokens_returns_an_empty_output():
    hidden, experts, weights, gate_up, down = _inputs()
    got = fast_experts_forward(hidden[:0], experts[:0], weights[:0], gate_up, down, SILU)
    assert got.shape == (0, hidden.shape[1]) and got.dtype == hidden.dtype


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_observe_routing_binds_the_fast_experts_and_keeps_the_models_function(family):
    plain = build_tiny_moe(TinyMoeConfig(family=family), seed=0)
    plain.config._experts_implementation = "eager"  # HF's per-expert loop
    fast = copy.deepcopy(plain)
    observe_routing(fast)
    experts = [m for m in fast.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == 2
    assert all(m.__dict__["forward"].__func__ is fast_experts_module_forward for m in experts)
    ids = torch.randint(3, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, fast(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


def test_an_experts_module_of_another_layout_is_refused_by_name():
    model = build_tiny_moe(TinyMoeConfig(family="qwen3_moe"), seed=0)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    experts.is_transposed = True
    with pytest.raises(TypeError, match="Qwen3MoeExperts: the fast experts forward needs"):
        observe_routing(model)


def test_both_combinations_compute_the_same_function_and_another_is_refused():
    hidden, experts, weights, gate_up, down = _inputs()
    bmm = fast_experts_forward(hidden, experts, weights, gate_up, down, SILU)
    elementwise = fast_experts_forward(hidden, experts, weights, gate_up, down, SILU, combine="elementwise")
    torch.testing.assert_close(elementwise, bmm, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="combine: 'sum'"):
        fast_experts_forward(hidden, experts, weights, gate_up, down, SILU, combine="sum")
