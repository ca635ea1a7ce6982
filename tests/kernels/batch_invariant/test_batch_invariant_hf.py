"""make_batch_invariant on the repo's tiny Qwen3: same function, row bits independent of the batch, fail closed."""
from __future__ import annotations

import copy

import pytest
import torch

from kernels.attention import REGISTRY, register_hf_attention
from kernels.attention.hf import packed_forward_kwargs
from kernels.batch_invariant.hf import BatchInvariantUnsupported, is_patched, make_batch_invariant
from recipes.tiny_model import TinyQwen3Config, build_tiny_qwen3

DTYPES = [torch.float32, torch.bfloat16]
SMALL = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128)


def _model(dtype=torch.float32, cfg=SMALL, seed=0):
    return build_tiny_qwen3(cfg, seed=seed).to(dtype)


def _sequences(vocab: int, lengths=(7, 3, 12, 1, 9), seed=0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def _packed_logits(model, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Logits [T, V] of `seqs` packed in one buffer through 'lockstep_packed' on the batch_invariant backend."""
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad(), REGISTRY.forced("batch_invariant"):
        out = model(input_ids=ids[None], use_cache=False, **packed_forward_kwargs(positions, cu, max(map(len, seqs))))
    return out.logits[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_model_computes_the_same_function(dtype):
    plain = _model(dtype)
    patched = make_batch_invariant(copy.deepcopy(plain))
    ids = torch.stack(_sequences(plain.config.vocab_size, lengths=(10, 10, 10)))
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits.float(), patched(input_ids=ids).logits.float()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (got - want).abs().max() <= tol * max(1.0, float(want.abs().max()))
    assert not torch.equal(got, torch.zeros_like(got))


def test_weights_and_names_are_untouched_and_every_op_patched():
    plain = _model()
    patched = make_batch_invariant(copy.deepcopy(plain))
    a, b = plain.state_dict(), patched.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [n for n, _ in plain.named_modules()] == [n for n, _ in patched.named_modules()]
    assert [type(m) for m in plain.modules()] == [type(m) for m in patched.modules()]
    linears = [m for m in patched.modules() if type(m) is torch.nn.Linear]
    norms = [m for m in patched.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    # q/k/v/o + gate/up/down per layer + lm_head; input/post-attention/q/k norms per layer + final norm.
    assert len(linears) == 7 * SMALL.num_hidden_layers + 1 and all(map(is_patched, linears))
    assert len(norms) == 4 * SMALL.num_hidden_layers + 1 and all(map(is_patched, norms))
    assert not any(map(is_patched, plain.modules()))
    make_batch_invariant(patched)  # idempotent
    assert all(map(is_patched, linears + norms))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_logits_do_not_depend_on_the_batch(dtype):
    model = make_batch_invariant(_model(dtype))
    model.set_attn_implementation(register_hf_attention())
    seqs = _sequences(model.config.vocab_size)
    alone = _packed_logits(model, [seqs[2]])
    for batch in ([seqs[0], seqs[2]], [seqs[2], seqs[4], seqs[1]], seqs, [seqs[3]] * 5 + [seqs[2]]):
        logits = _packed_logits(model, batch)
        start = next(sum(len(s) for s in batch[:i]) for i, s in enumerate(batch) if s is seqs[2])
        assert torch.equal(logits[start:start + len(seqs[2])], alone)


def test_lora_layers_are_covered_and_row_invariant():
    from services.trainer.model import lora
    from contract.trainer_settings import LoraSettings

    model = _model()
    lora.apply_lora(model, LoraSettings(rank=4, alpha=8.0))
    with torch.no_grad():  # non-zero B, so the adapters contribute
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    make_batch_invariant(model)
    adapters = [m for n, m in model.named_modules() if ".lora_A." in n or ".lora_B." in n]
    assert adapters and all(type(m) is torch.nn.Linear and is_patched(m) for m in adapters)
    model.set_attn_implementation(register_hf_attention())
    seqs = _sequences(model.config.vocab_size)
    assert torch.equal(_packed_logits(model, seqs)[:len(seqs[0])], _packed_logits(model, [seqs[0]]))


def test_lora_dropout_and_variants_are_refused():
    peft = pytest.importorskip("peft")

    for kwargs, reason in (({"lora_dropout": 0.1}, "torch.nn.modules.dropout.Dropout"),
                           ({"use_dora": True}, "LoRA variant")):
        model = _model()
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], **kwargs)
        peft.inject_adapter_in_model(cfg, model)
        with pytest.raises(BatchInvariantUnsupported, match=reason) as exc:
            make_batch_invariant(model)
        assert "model.layers.0.self_attn.q_proj" in exc.value.where
        assert not any(map(is_patched, model.modules()))  # nothing patched on refusal


def test_an_unknown_module_class_is_refused_naming_path_and_class():
    model = _model()
    model.model.layers[1].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(BatchInvariantUnsupported) as exc:
        make_batch_invariant(model)
    assert exc.value.where == "model.layers.1.mlp.act_fn"
    assert exc.value.what == "torch.nn.modules.activation.GELU"
    assert "model.layers.1.mlp.act_fn (torch.nn.modules.activation.GELU): module class not on the" in str(exc.value)
    assert not any(map(is_patched, model.modules()))


def _model_with(**config_updates):
    from transformers import Qwen3ForCausalLM

    from recipes.char_tokenizer import CharVocab
    from recipes.tiny_model import qwen3_config

    cfg = qwen3_config(SMALL, CharVocab().size)
    for k, v in config_updates.items():
        setattr(cfg, k, v)
    if "use_sliding_window" in config_updates:
        cfg.sliding_window = 8
        cfg.layer_types = ["sliding_attention" if i >= cfg.max_window_layers else "full_attention"
                           for i in range(cfg.num_hidden_layers)]
    return Qwen3ForCausalLM(cfg)


def test_a_sliding_window_config_is_refused():
    with pytest.raises(BatchInvariantUnsupported, match="config.layer_types.*sliding-window attention is not covered"):
        make_batch_invariant(_model_with(use_sliding_window=True, max_window_layers=1))


def test_rope_scaling_and_attention_dropout_are_refused():
    with pytest.raises(BatchInvariantUnsupported, match="config.rope_parameters.rope_type \\('linear'\\)"):
        make_batch_invariant(_model_with(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(BatchInvariantUnsupported, match="config.attention_dropout"):
        make_batch_invariant(_model_with(attention_dropout=0.1))


def test_attention_bias_is_handled():
    model = _model_with(attention_bias=True).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    plain = copy.deepcopy(model)
    make_batch_invariant(model)
    ids = torch.stack(_sequences(model.config.vocab_size, lengths=(6, 6)))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)


def test_the_rotary_table_is_pinned_to_float32():
    reference = _model()  # float32 table, as from_pretrained(dtype=...) leaves it
    model = _model(torch.bfloat16)  # .to(bfloat16) rounds the inv_freq buffer
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    make_batch_invariant(model)
    rotary = model.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)
    assert "model.rotary_emb.inv_freq" not in model.state_dict()
    x, pos = torch.zeros(1, 3, 8, dtype=torch.bfloat16), torch.arange(3)[None]
    assert all(torch.equal(a, b) for a, b in zip(rotary(x, pos), reference.model.rotary_emb(x, pos)))
    model.to(torch.bfloat16)  # after the patch: refused at the next forward, not silently rounded
    with pytest.raises(BatchInvariantUnsupported, match="inv_freq became torch.bfloat16"):
        rotary(x, pos)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_qwen2_and_llama_are_covered(family):
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if family == "qwen2":
        cfg = transformers.Qwen2Config(**shape)
        cls = transformers.Qwen2ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**shape, mlp_bias=True)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    plain = cls(cfg).eval()
    patched = make_batch_invariant(copy.deepcopy(plain))
    norms = [m for m in patched.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 2 + 1 and all(map(is_patched, norms))
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        assert torch.allclose(patched(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4)
