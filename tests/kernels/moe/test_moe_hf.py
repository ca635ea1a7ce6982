"""make_batch_invariant on tiny Qwen3-MoE and Qwen2-MoE (shared expert): Hugging Face's function, every
router and experts module patched, a sequence's logits and experts the same bits alone, batched and
reversed, exact ties to the lowest expert, and everything else still refused by name."""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.attention import REGISTRY, register_hf_attention
from kernels.attention.hf import packed_forward_kwargs
from kernels.batch_invariant.hf import BatchInvariantUnsupported, is_patched, make_batch_invariant
from kernels.moe.hf_blocks import router_states
from recipes.tiny_moe import TinyMoeConfig, build_tiny_moe

FAMILIES = ["qwen3_moe", "qwen2_moe"]


def _model(family, dtype=torch.float32, seed=0):
    return build_tiny_moe(TinyMoeConfig(family=family), seed=seed).to(dtype)


def _sequences(vocab, lengths=(7, 3, 12, 1, 9), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _packed(model, seqs):
    """(logits [T, V], experts of every layer [layers, T, k]) of `seqs` packed in one buffer."""
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        out = model(input_ids=ids[None], use_cache=False, **packed_forward_kwargs(positions, cu, max(map(len, seqs))))
    return out.logits[0], torch.stack([s.experts for s in router_states(model)])


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_moe_model_computes_hugging_faces_function(family):
    plain = _model(family)
    plain.config._experts_implementation = "eager"  # HF's per-expert loop: the plainest statement of the math
    patched = make_batch_invariant(copy.deepcopy(plain))
    ids = torch.stack(_sequences(plain.config.vocab_size, lengths=(10, 10, 10)))
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, patched(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))
    routers = [m for m in patched.modules() if type(m).__name__.endswith("TopKRouter")]
    experts = [m for m in patched.modules() if type(m).__name__.endswith("Experts")]
    linears = [m for m in patched.modules() if type(m) is torch.nn.Linear]
    assert len(routers) == len(experts) == 2 and all(map(is_patched, routers + experts + linears))
    assert not any(map(is_patched, plain.modules()))
    a, b = plain.state_dict(), patched.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequences_logits_and_experts_do_not_depend_on_the_batch(family, dtype):
    model = make_batch_invariant(_model(family, dtype))
    model.set_attn_implementation(register_hf_attention())
    seqs = _sequences(model.config.vocab_size)
    target = seqs[2]
    alone_logits, alone_experts = _packed(model, [target])
    for batch in ([seqs[0], target], seqs, list(reversed(seqs)), [seqs[3]] * 5 + [target]):
        logits, experts = _packed(model, batch)
        start = next(sum(len(s) for s in batch[:i]) for i, s in enumerate(batch) if s is target)
        assert torch.equal(logits[start:start + len(target)], alone_logits)
        assert torch.equal(experts[:, start:start + len(target)], alone_experts)
    assert len(set(alone_experts.reshape(-1).tolist())) > 2  # the routing is not degenerate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_with_exactly_equal_router_logits_go_to_the_lowest_index(dtype):
    model = _model("qwen3_moe", dtype)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight[3] = gate.weight[1] * 50   # rows 3, 5 and 6 identical and dominant:
        gate.weight[5] = gate.weight[3]        # every token's logits tie exactly among them
        gate.weight[6] = gate.weight[3]
        gate.weight[1] = 0
    make_batch_invariant(model)
    model.set_attn_implementation(register_hf_attention())
    seqs = _sequences(model.config.vocab_size)
    _logits, experts = _packed(model, seqs)
    probs = router_states(model)[0].probs
    tied = probs[:, 3] == probs.amax(-1)  # tokens whose largest logit is the three-way tie
    assert torch.equal(probs[:, 3], probs[:, 5]) and torch.equal(probs[:, 3], probs[:, 6])
    assert int(tied.sum()) >= len(seqs)
    assert (experts[0][tied] == torch.tensor([3, 5])).all()
    _logits, reversed_experts = _packed(model, list(reversed(seqs)))
    assert torch.equal(reversed_experts[0, -len(seqs[0]):], experts[0, :len(seqs[0])])


def test_other_mixture_of_experts_families_are_refused_by_name():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4)
    with pytest.raises(BatchInvariantUnsupported, match=r"config\.model_type \('mixtral'\)"):
        make_batch_invariant(MixtralForCausalLM(cfg))


def test_an_unknown_module_inside_an_moe_model_is_refused_naming_path_and_class():
    model = _model("qwen3_moe")

    class HomemadeExperts(torch.nn.Module):
        def forward(self, hidden, top_k_index, top_k_weights):
            return hidden

    model.model.layers[1].mlp.experts = HomemadeExperts()
    with pytest.raises(BatchInvariantUnsupported) as info:
        make_batch_invariant(model)
    assert info.value.where == "model.layers.1.mlp.experts" and "HomemadeExperts" in info.value.what
    assert not any(map(is_patched, model.modules()))  # nothing patched
