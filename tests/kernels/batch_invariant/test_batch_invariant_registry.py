"""The `batch_invariant` attention backend through the registry contract, and a packed HF Qwen3 on it.

The HF check patches every nn.Linear and RMSNorm of a tiny Qwen3 onto bi_linear / bi_rms_norm here
by hand (the model-patching API lives elsewhere); with the backend forced, a packed forward gives
every sequence the same logits, bit for bit, as that sequence alone, on any number of CPU threads
(the plain model only manages that on one thread, and not for every length).
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import (
    REGISTRY,
    AttentionBackendError,
    PackedLayout,
    packed_causal_attention,
    packed_forward_kwargs,
    register_hf_attention,
)
from kernels.batch_invariant import bi_linear, bi_rms_norm, packed_attention
from tests.kernels.batch_invariant.batch_invariant_support import assert_bitwise, make_qkv

transformers = pytest.importorskip("transformers")
LENGTHS = [1, 7, 70, 3, 130]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forced_backend_is_packed_attention_under_the_contract(dtype):
    q, k, v = make_qkv(sum(LENGTHS), 4, 2, 16, dtype, seed=0)
    lay = PackedLayout.from_lengths(LENGTHS)
    REGISTRY.reset_usage()
    with REGISTRY.forced("batch_invariant"):
        out = packed_causal_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen)
    assert REGISTRY.usage() == {"batch_invariant": 1}
    assert_bitwise(out, packed_attention(q, k, v, lay.cu_seqlens, lay.max_seqlen, 16 ** -0.5), "registry vs direct")


def test_backend_is_never_auto_selected_and_declares_what_it_offers():
    backend = REGISTRY.get("batch_invariant")
    assert REGISTRY.names()[-1] == "batch_invariant"  # after the reference: used only when forced
    assert set(backend.capabilities) == {"cpu", "cuda", "rocm"}
    for platform, cap in backend.capabilities.items():
        assert cap.honours_boundaries and cap.deterministic and not cap.sliding_window, platform
        assert cap.dtypes == {torch.float32, torch.float16, torch.bfloat16}
    assert backend.capabilities["cuda"].max_head_dim == 256
    auto = REGISTRY.select(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, packed=True, window=None)
    assert auto.name == "reference"
    with REGISTRY.forced("batch_invariant"):
        with pytest.raises(AttentionBackendError, match="'batch_invariant' refused: it does not support a sliding"):
            REGISTRY.select(device=torch.device("cpu"), dtype=torch.float32, head_dim=16, packed=True, window=8)
        with pytest.raises(AttentionBackendError, match="'batch_invariant' refused: it does not support head_dim=512"):
            REGISTRY.select(device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=512, packed=True,
                            window=None)
    # Deterministic runs may force it (the trainer's deterministic mode turns this on).
    with REGISTRY.use_policy(REGISTRY.policy.model_copy(update={"backend": "batch_invariant",
                                                                "require_deterministic": True})):
        assert REGISTRY.select(device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=128, packed=True,
                               window=None).name == "batch_invariant"


def _tiny_batch_invariant_qwen3(dtype):
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(dtype).eval()
    norm_cls = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = lambda x, m=module: bi_linear(x, m.weight, m.bias)
        elif isinstance(module, norm_cls):
            module.forward = lambda x, m=module: bi_rms_norm(x, m.weight, m.variance_epsilon)
    model.set_attn_implementation(register_hf_attention())
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_hf_qwen3_on_batch_invariant_ops_equals_each_sequence_alone(dtype):
    model = _tiny_batch_invariant_qwen3(dtype)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128, (n,), generator=g) for n in LENGTHS]
    lay = PackedLayout.from_lengths(LENGTHS)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])

    def forward(ids, layout, pos):
        kw = packed_forward_kwargs(pos, layout.cu_seqlens, layout.max_seqlen)
        return model(input_ids=ids[None], **kw).logits[0]

    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        packed = forward(torch.cat(seqs), lay, positions)
        start = 0
        for s in seqs:
            alone = forward(s, PackedLayout.from_lengths([s.numel()]), torch.arange(s.numel()))
            assert_bitwise(packed[start:start + s.numel()], alone, f"{dtype} sequence of {s.numel()} tokens")
            start += s.numel()
