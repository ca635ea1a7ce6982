"""The embedded decoder on CPU: agreement with HF's own cached generation, batch independence, true on-policy.

A tiny stock Qwen3 (recipes/tiny_model.py) with a large init std, so
distributions are far from uniform and a position or cache bug moves
log-probs by far more than the tolerances here.
"""
from __future__ import annotations


import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.embedded.decoder_attention import DecoderUnsupported
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.types import GenerationRequest, PromptSpec
from tests.rollout.decoder_support import (
    PROMPTS,
    SEEDS,
    TINY,
    TOLERANCE,
    dynamic_cache_logprobs,
    loaded,
    sampling,
)


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_decode_matches_hf_dynamic_cache_generation(decoder_model_dir, dtype):
    decoder = Decoder(loaded(decoder_model_dir, dtype), DecoderOptions(max_batch_size=8))
    cfg = sampling(temperature=1.1, top_k=12)
    rows = decoder.decode(PROMPTS, SEEDS, cfg)
    assert [len(r.token_ids) for r in rows] == [12] * len(PROMPTS)
    reference = dynamic_cache_logprobs(loaded(decoder_model_dir, dtype), PROMPTS, [r.token_ids for r in rows], 1.1)
    gaps = [(ref - torch.tensor(r.logprobs)).abs().max().item() for ref, r in zip(reference, rows)]
    print(f"{dtype}: decoder vs HF DynamicCache max |dlogp| = {max(gaps):.3e}")
    assert max(gaps) <= TOLERANCE[dtype]
    # Control: the same comparison against responses shifted by one token fails by far.
    shifted = dynamic_cache_logprobs(loaded(decoder_model_dir, dtype), PROMPTS, [r.token_ids[1:] for r in rows], 1.1)
    assert max((s - torch.tensor(r.logprobs[:-1])).abs().max().item() for s, r in zip(shifted, rows)) > 0.2


def test_a_samples_tokens_do_not_depend_on_its_batch(decoder_model_dir):
    """The same (prompt, seed) alone, in a mixed batch, reordered or in micro-batches of 2: same tokens (fast
    numerics promise tokens, not log-prob bits: GEMM shapes change with the batch)."""
    cfg = sampling(top_p=0.9)
    full = Decoder(loaded(decoder_model_dir, "bfloat16"), DecoderOptions(max_batch_size=8))
    mixed = full.decode(PROMPTS, SEEDS, cfg)
    alone = [full.decode([p], [s], cfg)[0] for p, s in zip(PROMPTS, SEEDS)]
    reordered = full.decode(PROMPTS[::-1], SEEDS[::-1], cfg)[::-1]
    chunked = Decoder(loaded(decoder_model_dir, "bfloat16"), DecoderOptions(max_batch_size=2)).decode(PROMPTS, SEEDS, cfg)
    for other in (alone, reordered, chunked):
        assert [r.token_ids for r in other] == [r.token_ids for r in mixed]
    # The seed is what matters: another seed for one prompt changes its tokens.
    assert full.decode([PROMPTS[1]], [SEEDS[1] + 1], cfg)[0].token_ids != mixed[1].token_ids


def test_stop_tokens_end_rows_and_finished_rows_do_not_disturb_others(decoder_model_dir):
    model = loaded(decoder_model_dir, "float32")
    decoder = Decoder(model, DecoderOptions(max_batch_size=8))
    stops = (4, 5, 6)
    cfg = sampling(temperature=1.0, max_new_tokens=16, stop_token_ids=stops)
    rows = decoder.decode(PROMPTS, SEEDS, cfg)
    assert {r.finish_reason for r in rows} == {"stop", "length"}, [r.token_ids for r in rows]
    for r in rows:
        assert len(r.token_ids) == len(r.logprobs)
        assert not set(r.token_ids[:-1]) & set(stops)
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in stops
        else:
            assert len(r.token_ids) == 16
    # Rows that stopped early left the others' tokens and log-probs unchanged (within fp32 rounding).
    free = decoder.decode(PROMPTS, SEEDS, sampling(temperature=1.0, max_new_tokens=16))
    for r, f in zip(rows, free):
        assert r.token_ids == f.token_ids[:len(r.token_ids)]
        assert max(abs(a - b) for a, b in zip(r.logprobs, f.logprobs)) <= 1e-5


def test_decoding_ends_once_every_row_has_stopped(decoder_model_dir):
    decoder = Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions(max_batch_size=8))
    steps = []
    forward = decoder._decode_logits
    decoder._decode_logits = lambda *a: steps.append(1) or forward(*a)
    vocab = decoder.model.config.vocab_size
    rows = decoder.decode(PROMPTS, SEEDS, sampling(max_new_tokens=50, stop_token_ids=tuple(range(vocab))))
    assert all(len(r.token_ids) == 1 and r.finish_reason == "stop" for r in rows)
    assert steps == []  # every row stopped on the token its prefill sampled: no decode step runs


def test_refused_options_and_models(decoder_model_dir, tmp_path):
    with pytest.raises(ValueError, match="engine_config.cuda_graphs: .*CUDA device"):
        TorchEngineConfig.from_json('{"cuda_graphs": true}')
    with pytest.raises(ValueError, match="engine_config.numerics: .*float16"):
        TorchEngineConfig.from_json('{"numerics": "true_on_policy", "dtype": "float16"}')
    with pytest.raises(ValueError, match="engine_config.numerics"):
        TorchEngineConfig.from_json('{"numerics": "exact"}')
    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs need a CUDA device"):
        Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions(cuda_graphs=True))
    sliding = loaded(decoder_model_dir, "float32")
    sliding.config.layer_types = ["sliding_attention"] * TINY.num_hidden_layers
    with pytest.raises(DecoderUnsupported, match="sliding-window"):
        Decoder(sliding, DecoderOptions())
    engine = TorchEngine(TorchEngineConfig(max_context_tokens=16))
    engine.load(str(decoder_model_dir), 0)
    req = GenerationRequest(prompts=(PromptSpec("g", PROMPTS[1], 0),), sampling=sampling(max_new_tokens=6))
    with pytest.raises(ValueError, match="sampling.max_new_tokens: .*max_context_tokens=16"):
        engine.generate(req)


def test_engine_reports_decoder_rows_and_keeps_the_model_stock(decoder_model_dir):
    """Through the engine: order, seeds (prompt.seed + i) and a plain HF forward still working after a decode."""
    engine = TorchEngine(TorchEngineConfig(dtype="float32", max_batch_size=4))
    engine.load(str(decoder_model_dir), 0)
    prompts = tuple(PromptSpec(f"g{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, SEEDS)))
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sampling(), samples_per_prompt=2))
    assert [(s.group_id, s.index) for s in samples] == [(p.group_id, i) for p in prompts for i in range(2)]
    direct = Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions(max_batch_size=4)).decode(
        [p.token_ids for p in prompts for _ in range(2)], [p.seed + i for p in prompts for i in range(2)],
        sampling())
    assert [s.token_ids for s in samples] == [d.token_ids for d in direct]
    with torch.no_grad():
        logits = engine._require_model()(input_ids=torch.tensor([PROMPTS[1]])).logits
    assert logits.shape[1] == len(PROMPTS[1])
    info = engine.info()
    assert (info["numerics"], info["cuda_graphs"], info["prefill_attention"], info["decode_attention"]) == (
        "fast", "false", "reference", "sdpa")


def test_fast_prefill_takes_the_registry_backend_or_the_batch_invariant_kernel(decoder_model_dir):
    """Fast prefill runs the registry's choice; where auto-selection finds none it runs the batch-invariant
    packed kernel, and a backend forced by policy that cannot serve is an error, never replaced."""
    from contract.trainer_settings import AttentionPolicy
    from kernels.attention import REGISTRY, AttentionBackendError

    assert Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions()).prefill_attention == "reference"
    reference = REGISTRY.get("reference")
    REGISTRY.unregister("reference")  # the only CPU backend: auto-selection now finds none
    try:
        decoder = Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions())
        assert decoder.prefill_attention == "batch_invariant"
        rows = decoder.decode(PROMPTS, SEEDS, sampling())
    finally:
        REGISTRY.register(reference)
    assert [r.token_ids for r in rows] == [r.token_ids for r in
                                           Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions()).decode(
                                               PROMPTS, SEEDS, sampling())]
    with REGISTRY.use_policy(AttentionPolicy(backend="flash_attn")), pytest.raises(AttentionBackendError):
        Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions())


def test_decode_under_deterministic_algorithms_as_the_service_runs(decoder_model_dir):
    """The rollout service enables torch's deterministic mode: decoding works under it, gives the same rows,
    and leaves the mode on (the cache writes switch it off only around their unique-index copies)."""
    decoder = Decoder(loaded(decoder_model_dir, "float32"), DecoderOptions(max_batch_size=8))
    free = decoder.decode(PROMPTS, SEEDS, sampling())
    torch.use_deterministic_algorithms(True)
    try:
        strict = decoder.decode(PROMPTS, SEEDS, sampling())
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
    assert [r.token_ids for r in strict] == [r.token_ids for r in free]
    assert [r.logprobs for r in strict] == [r.logprobs for r in free]


def test_the_decoder_attention_refuses_calls_outside_a_decode(decoder_model_dir):
    """The attention function fails closed: without the KV pool kwarg, or given a mask, it raises."""
    from services.rollout.embedded.kv_cache import KVStep, PagedKVPool, decoder_attention_forward

    layer = loaded(decoder_model_dir, "float32").model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(RuntimeError, match="without the lockstep_kv forward kwarg"):
        decoder_attention_forward(layer, q, kv, kv, None)
    pool = PagedKVPool(layers=2, pages=2, kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    step = KVStep.prefill(pool, torch.ones(3, dtype=torch.long), torch.arange(3), lambda *a: a[0])
    with pytest.raises(RuntimeError, match="got an attention mask"):
        decoder_attention_forward(layer, q, kv, kv, torch.zeros(1, 1, 3, 3), lockstep_kv=step)
    with pytest.raises(RuntimeError, match="sliding windows"):
        decoder_attention_forward(layer, q, kv, kv, None, sliding_window=4, lockstep_kv=step)
