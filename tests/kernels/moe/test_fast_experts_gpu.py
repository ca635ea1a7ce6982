"""kernels/moe/fast_experts.py on a GPU at the Qwen3-30B-A3B layer shape, bf16 (`gpu` marker; CI without a GPU
deselects it): under torch's deterministic algorithms (the trainer's setting) forward and backward run and give
the same bits twice; the output and input gradient are Hugging Face's grouped_mm experts' within bf16
rounding; and the forward replays under CUDA graph capture (the engine's decode step) with the eager bits."""
from __future__ import annotations

import pytest
import torch

from kernels.moe.fast_experts import fast_experts_forward
from tests.conftest import require

pytestmark = pytest.mark.gpu

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 128, 8, 768
SILU = torch.nn.functional.silu


@pytest.fixture(autouse=True)
def _cuda():
    require(torch.cuda.is_available(), "no CUDA device")
    torch.cuda.synchronize()


def _inputs(tokens, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    experts = torch.rand(tokens, EXPERTS, device="cuda", generator=g).argsort(-1)[:, :TOP_K]
    weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=g), -1).bfloat16()
    hidden = torch.randn(tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g) * HIDDEN ** -0.5).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * INTER ** -0.5).bfloat16()
    return hidden, experts, weights, gate_up, down


def _forward_backward(hidden, experts, weights, gate_up, down, upstream):
    leaves = [t.clone().requires_grad_() for t in (hidden, weights, gate_up, down)]
    out = fast_experts_forward(leaves[0], experts, leaves[1], leaves[2], leaves[3], SILU)
    out.backward(upstream)
    return [out.detach()] + [t.grad for t in leaves]


def test_deterministic_algorithms_run_it_and_it_gives_the_same_bits_twice():
    hidden, experts, weights, gate_up, down = _inputs(4096, 0)
    upstream = torch.randn_like(hidden)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)  # an op without a deterministic CUDA path raises here
    try:
        first = _forward_backward(hidden, experts, weights, gate_up, down, upstream)
        second = _forward_backward(hidden, experts, weights, gate_up, down, upstream)
    finally:
        torch.use_deterministic_algorithms(before)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_output_and_input_gradient_are_hugging_faces_grouped_mm_experts_within_bf16_rounding():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hidden, experts, weights, gate_up, down = _inputs(2048, 1)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            moe_intermediate_size=INTER)
    config._experts_implementation = "grouped_mm"
    module = Qwen3MoeExperts(config).cuda().bfloat16()
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    upstream = torch.randn_like(hidden)
    x = hidden.clone().requires_grad_()
    want = module(x, experts, weights)
    want.backward(upstream)
    out, grad_hidden, *_ = _forward_backward(hidden, experts, weights, gate_up, down, upstream)
    for got, ref in ((out, want.detach()), (grad_hidden, x.grad)):
        # Both round to bf16 from float32 sums in other orders: a few bf16 ulps of the tensor's scale.
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_the_forward_replays_under_cuda_graph_capture_with_the_eager_bits():
    hidden, experts, weights, gate_up, down = _inputs(256, 2)
    static = [hidden.clone(), experts.clone(), weights.clone()]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fast_experts_forward(*static, gate_up, down, SILU)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast_experts_forward(*static, gate_up, down, SILU)
        other = _inputs(256, 3)
        for dst, src in zip(static, other[:3]):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, fast_experts_forward(*other[:3], gate_up, down, SILU))
