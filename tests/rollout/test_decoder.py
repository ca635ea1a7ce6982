"""The embedded decoder on CPU: agreement with HF's own cached generation, batch independence, true on-policy.

A tiny stock Qwen3 (services/common/tiny_model.py) with a large init std, so
distributions are far from uniform and a position or cache bug moves
log-probs by far more than the tolerances here.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from kernels.logprob import token_logprobs
from services.common.models import load_causal_lm
from services.common.tiny_model import TinyQwen3Config, build_model_dir
from services.rollout.decoder import Decoder, DecoderOptions, DecoderUnsupported
from services.rollout.engine import GenerationRequest, PromptSpec, SamplingConfig
from services.rollout.torch_engine import TorchEngine, TorchEngineConfig

TINY = TinyQwen3Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, max_position_embeddings=128, initializer_range=0.3)
PROMPTS = [(3, 4), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), (5, 9, 2, 13), (7,), (6, 6, 6, 6, 6, 6)]
SEEDS = [11, 1000, 77, 5, 2**40 + 1]
TOLERANCE = {"float32": 1e-5, "bfloat16": 8e-2}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny"), TINY, seed=3)


def loaded(model_dir: Path, dtype: str) -> torch.nn.Module:
    model = load_causal_lm(model_dir, dtype=dtype)
    model.eval().requires_grad_(False)
    return model


def sampling(**kw) -> SamplingConfig:
    return SamplingConfig(**{"temperature": 0.8, "max_new_tokens": 12, **kw})


def dynamic_cache_logprobs(model, prompts, responses, temperature: float, pad: int = 0) -> list[torch.Tensor]:
    """The engine's previous generation path, teacher-forced on `responses`: one left-padded batch, HF's
    DynamicCache, one column per step, the attention mask hiding the padding."""
    from transformers import DynamicCache

    lmax = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), lmax), pad)
    mask = torch.zeros((len(prompts), lmax), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, lmax - len(p):] = torch.tensor(p)
        mask[b, lmax - len(p):] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache(config=model.config)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                       **{cache_arg: cache}).logits[:, -1]
        next_pos = mask.sum(-1, keepdim=True)
        for t in range(max(len(r) for r in responses)):
            tok = torch.tensor([r[t] if t < len(r) else pad for r in responses])
            out.append(token_logprobs(logits, tok, temperature=temperature)[0])
            mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype)], dim=-1)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                           **{cache_arg: cache}).logits[:, -1]
            next_pos = next_pos + 1
    steps = torch.stack(out, dim=1)
    return [steps[b, :len(r)] for b, r in enumerate(responses)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_decode_matches_hf_dynamic_cache_generation(model_dir, dtype):
    decoder = Decoder(loaded(model_dir, dtype), DecoderOptions(max_batch_size=8))
    cfg = sampling(temperature=1.1, top_k=12)
    rows = decoder.decode(PROMPTS, SEEDS, cfg)
    assert [len(r.token_ids) for r in rows] == [12] * len(PROMPTS)
    reference = dynamic_cache_logprobs(loaded(model_dir, dtype), PROMPTS, [r.token_ids for r in rows], 1.1)
    gaps = [(ref - torch.tensor(r.logprobs)).abs().max().item() for ref, r in zip(reference, rows)]
    print(f"{dtype}: decoder vs HF DynamicCache max |dlogp| = {max(gaps):.3e}")
    assert max(gaps) <= TOLERANCE[dtype]
    # Control: the same comparison against responses shifted by one token fails by far.
    shifted = dynamic_cache_logprobs(loaded(model_dir, dtype), PROMPTS, [r.token_ids[1:] for r in rows], 1.1)
    assert max((s - torch.tensor(r.logprobs[:-1])).abs().max().item() for s, r in zip(shifted, rows)) > 0.2


@pytest.mark.parametrize("numerics", ["fast"])
def test_a_samples_tokens_do_not_depend_on_its_batch(model_dir, numerics):
    """The same (prompt, seed) alone, in a mixed batch, or in micro-batches of 2 and 1: same tokens; in
    true_on_policy also the same log-prob bits."""
    cfg = sampling(top_p=0.9)
    full = Decoder(loaded(model_dir, "bfloat16"), DecoderOptions(numerics=numerics, max_batch_size=8))
    mixed = full.decode(PROMPTS, SEEDS, cfg)
    alone = [full.decode([p], [s], cfg)[0] for p, s in zip(PROMPTS, SEEDS)]
    reordered = full.decode(PROMPTS[::-1], SEEDS[::-1], cfg)[::-1]
    pairs = Decoder(loaded(model_dir, "bfloat16"), DecoderOptions(numerics=numerics, max_batch_size=2))
    chunked = pairs.decode(PROMPTS, SEEDS, cfg)
    for other in (alone, reordered, chunked):
        assert [r.token_ids for r in other] == [r.token_ids for r in mixed]
        if numerics == "true_on_policy":
            assert [r.logprobs for r in other] == [r.logprobs for r in mixed]
    # The seed is what matters: another seed for one prompt changes its tokens.
    assert full.decode([PROMPTS[1]], [SEEDS[1] + 1], cfg)[0].token_ids != mixed[1].token_ids


def test_stop_tokens_end_rows_and_finished_rows_do_not_disturb_others(model_dir):
    model = loaded(model_dir, "float32")
    decoder = Decoder(model, DecoderOptions(max_batch_size=8, stop_check_interval=3))
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


def test_decoding_ends_once_every_row_has_stopped(model_dir):
    decoder = Decoder(loaded(model_dir, "float32"), DecoderOptions(max_batch_size=8, stop_check_interval=2))
    steps = []
    forward = decoder._decode_logits
    decoder._decode_logits = lambda *a: steps.append(1) or forward(*a)
    vocab = decoder.model.config.vocab_size
    rows = decoder.decode(PROMPTS, SEEDS, sampling(max_new_tokens=50, stop_token_ids=tuple(range(vocab))))
    assert all(len(r.token_ids) == 1 and r.finish_reason == "stop" for r in rows)
    assert len(steps) == 1  # step 0 from the prefill, one decode step, then the check at step 2 ends it


def test_refused_options_and_models(model_dir, tmp_path):
    with pytest.raises(ValueError, match="engine_config.cuda_graphs: .*CUDA device"):
        TorchEngineConfig.from_json('{"cuda_graphs": true}')
    with pytest.raises(ValueError, match="engine_config.numerics: .*float16"):
        TorchEngineConfig.from_json('{"numerics": "true_on_policy", "dtype": "float16"}')
    with pytest.raises(ValueError, match="engine_config.numerics"):
        TorchEngineConfig.from_json('{"numerics": "exact"}')
    with pytest.raises(ValueError, match="cuda_graphs: CUDA graphs need a CUDA device"):
        Decoder(loaded(model_dir, "float32"), DecoderOptions(cuda_graphs=True))
    sliding = loaded(model_dir, "float32")
    sliding.config.layer_types = ["sliding_attention"] * TINY.num_hidden_layers
    with pytest.raises(DecoderUnsupported, match="sliding-window"):
        Decoder(sliding, DecoderOptions())
    engine = TorchEngine(TorchEngineConfig(max_context_tokens=16))
    engine.load(str(model_dir), 0)
    req = GenerationRequest(prompts=(PromptSpec("g", PROMPTS[1], 0),), sampling=sampling(max_new_tokens=6))
    with pytest.raises(ValueError, match="sampling.max_new_tokens: .*max_context_tokens=16"):
        engine.generate(req)


def test_engine_reports_decoder_rows_and_keeps_the_model_stock(model_dir):
    """Through the engine: order, seeds (prompt.seed + i) and a plain HF forward still working after a decode."""
    engine = TorchEngine(TorchEngineConfig(dtype="float32", max_batch_size=4))
    engine.load(str(model_dir), 0)
    prompts = tuple(PromptSpec(f"g{i}", p, s) for i, (p, s) in enumerate(zip(PROMPTS, SEEDS)))
    samples = engine.generate(GenerationRequest(prompts=prompts, sampling=sampling(), samples_per_prompt=2))
    assert [(s.group_id, s.index) for s in samples] == [(p.group_id, i) for p in prompts for i in range(2)]
    direct = Decoder(loaded(model_dir, "float32"), DecoderOptions(max_batch_size=4)).decode(
        [p.token_ids for p in prompts for _ in range(2)], [p.seed + i for p in prompts for i in range(2)],
        sampling())
    assert [s.token_ids for s in samples] == [d.token_ids for d in direct]
    with torch.no_grad():
        logits = engine._require_model()(input_ids=torch.tensor([PROMPTS[1]])).logits
    assert logits.shape[1] == len(PROMPTS[1])
    assert engine.info()["numerics"] == "fast" and engine.info()["cuda_graphs"] == "false"
