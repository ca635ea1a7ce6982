"""The decoder in true_on_policy numerics on CPU: batch-invariant bits and the trainer's packed recompute.

Every op from token ids to log-probs is batch-invariant (kernels.batch_invariant, the model patched by
make_batch_invariant), so a sample's log-probs are the same bits alone or in any batch, and equal to one
packed forward over the whole sequences, as the trainer scores them.
"""
from __future__ import annotations

import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.types import GenerationRequest, PromptSpec
from tests.rollout.decoder_support import (
    PROMPTS,
    SEEDS,
    batch_invariant_scorer,
    dynamic_cache_logprobs,
    loaded,
    packed_recompute,
    sampling,
)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")



def test_a_samples_bits_do_not_depend_on_its_batch(decoder_model_dir):
    """The same (prompt, seed) alone, reordered, or in micro-batches of 2: same tokens and log-prob bits."""
    cfg = sampling(top_p=0.9)
    full = Decoder(loaded(decoder_model_dir, "bfloat16"), DecoderOptions(numerics="true_on_policy", max_batch_size=8))
    mixed = full.decode(PROMPTS, SEEDS, cfg)
    alone = [full.decode([p], [s], cfg)[0] for p, s in zip(PROMPTS, SEEDS)]
    reordered = full.decode(PROMPTS[::-1], SEEDS[::-1], cfg)[::-1]
    pairs = Decoder(loaded(decoder_model_dir, "bfloat16"), DecoderOptions(numerics="true_on_policy", max_batch_size=2))
    for other in (alone, reordered, pairs.decode(PROMPTS, SEEDS, cfg)):
        assert [r.token_ids for r in other] == [r.token_ids for r in mixed]
        assert [r.logprobs for r in other] == [r.logprobs for r in mixed]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_equal_a_packed_recompute_bitwise(decoder_model_dir, dtype):
    decoder = Decoder(loaded(decoder_model_dir, dtype), DecoderOptions(numerics="true_on_policy", max_batch_size=8))
    cfg = sampling(temperature=0.9, max_new_tokens=20)
    rows = decoder.decode(PROMPTS, SEEDS, cfg)
    responses = [r.token_ids for r in rows]
    recomputed = packed_recompute(batch_invariant_scorer(loaded(decoder_model_dir, dtype)), PROMPTS, responses, 0.9)
    assert [r.logprobs for r in rows] == recomputed
    # Control: HF's own cached decode of the same tokens does not reproduce those bits.
    teacher = dynamic_cache_logprobs(loaded(decoder_model_dir, dtype), PROMPTS, responses, 0.9)
    assert [t.float().tolist() for t in teacher] != recomputed


def _tiny(family: str, **extra) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    cfg = config_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=128, initializer_range=0.3,
                     tie_word_embeddings=False, **extra)
    torch.manual_seed(5)
    return model_cls(cfg).to(torch.bfloat16).eval().requires_grad_(False)


@pytest.mark.parametrize("family,extra", [("qwen2", {}), ("llama", {"attention_bias": True})], ids=["qwen2", "llama"])
def test_the_fused_decode_step_gives_the_stock_steps_bits(family, extra):
    """Qwen2 (q/k/v biases) and Llama (all four attention biases), no q/k norms: the fused step's wiring against
    the stock forward (Qwen3 is the decoder model of every other test here)."""
    model = _tiny(family, **extra)
    fused = Decoder(model, DecoderOptions(numerics="true_on_policy", max_batch_size=4))
    stock = Decoder(model, DecoderOptions(numerics="true_on_policy", max_batch_size=4, fused_step=False))
    assert (fused.decode_forward, stock.decode_forward) == ("fused", "hf")
    cfg = sampling(max_new_tokens=10)
    rows = fused.decode(PROMPTS, SEEDS, cfg)
    assert [(r.token_ids, r.logprobs) for r in rows] == [(r.token_ids, r.logprobs) for r in stock.decode(PROMPTS, SEEDS,
                                                                                                          cfg)]
    assert len({tuple(r.token_ids) for r in rows}) > 1


def test_a_model_the_fused_step_does_not_cover_decodes_on_the_stock_forward():
    decoder = Decoder(_tiny("llama", mlp_bias=True), DecoderOptions(numerics="true_on_policy", max_batch_size=4))
    assert decoder.decode_forward == "hf"
    assert len(decoder.decode(PROMPTS[:2], SEEDS[:2], sampling(max_new_tokens=3))[0].token_ids) == 3


def test_engine_in_true_on_policy_reports_the_recompute_bits(decoder_model_dir):
    engine = TorchEngine(TorchEngineConfig(dtype="bfloat16", numerics="true_on_policy", max_batch_size=3))
    engine.load(str(decoder_model_dir), 0)
    info = engine.info()
    assert (info["numerics"], info["prefill_attention"], info["decode_attention"], info["decode_forward"]) == (
        "true_on_policy", "batch_invariant", "batch_invariant", "fused")
    prompts = tuple(PromptSpec(f"g{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, SEEDS)))
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sampling(), samples_per_prompt=2))
    scorer = batch_invariant_scorer(loaded(decoder_model_dir, "bfloat16"))
    recomputed = packed_recompute(scorer, [p.token_ids for p in prompts for _ in range(2)],
                                  [s.token_ids for s in samples], sampling().temperature)
    assert [s.logprobs for s in samples] == recomputed
    with torch.no_grad():  # the patched model still serves a plain forward outside a decode
        engine._require_model()(input_ids=torch.tensor([PROMPTS[0]]))


def test_a_model_outside_the_mode_is_refused_at_load(decoder_model_dir, tmp_path):
    """A GELU MLP has no batch-invariant cover: LoadModel fails naming the option, nothing half-patched runs."""
    import json
    import shutil

    gelu = shutil.copytree(decoder_model_dir, tmp_path / "gelu")
    cfg = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    engine = TorchEngine(TorchEngineConfig(numerics="true_on_policy"))
    with pytest.raises(ValueError, match=r"engine_config.numerics: .*config.hidden_act"):
        engine.load(str(gelu), 0)
    with pytest.raises(RuntimeError, match="no model loaded"):
        engine.generate(GenerationRequest(prompts=(PromptSpec("g", PROMPTS[0], 0),), sampling=sampling()))
    fast = TorchEngine(TorchEngineConfig())  # the fast decoder runs any model HF runs
    fast.load(str(gelu), 0)
    assert len(fast.generate(GenerationRequest(prompts=(PromptSpec("g", PROMPTS[0], 0),),
                                               sampling=sampling()))[0].token_ids) == 12
