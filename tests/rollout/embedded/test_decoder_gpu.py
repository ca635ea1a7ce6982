"""The decoder on a CUDA GPU (run on the device machine; CI deselects `gpu`).

Random-init stock Qwen3 models built on the device (same seed -> same weights), bf16, decoded under
torch's deterministic mode as the rollout service runs. CUDA graph replay must give the eager bits; in
true_on_policy every log-prob must equal the packed batch-invariant recompute bit for bit; the last test
prints throughput at the Qwen3-0.6B shape (not asserted).
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from services.rollout.embedded.decoder import Decoder, DecoderOptions
from services.rollout.types import SamplingConfig
from tests.conftest import require
from tests.rollout.decoder_support import batch_invariant_scorer, packed_recompute

pytestmark = pytest.mark.gpu

SMALL = dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=128, intermediate=512, vocab=4096)
QWEN3_0_6B = dict(layers=28, hidden=1024, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936)
PROMPT_LENGTHS = [5, 17, 33, 64, 1, 100, 7, 48]


@pytest.fixture(autouse=True)
def cuda_deterministic():
    require(torch.cuda.is_available(), "no CUDA device")
    from services.common.determinism import configure_determinism

    before = torch.are_deterministic_algorithms_enabled()
    configure_determinism(0)
    yield
    torch.use_deterministic_algorithms(before)


def qwen3(shape: dict, seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    model.set_attn_implementation("sdpa")
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def prompts(lengths: list[int], vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def decode(numerics: str, graphs: bool, batch: list[list[int]], cfg: SamplingConfig, **options):
    decoder = Decoder(qwen3(SMALL), DecoderOptions(numerics=numerics, cuda_graphs=graphs, **options))
    return decoder.decode(batch, [100 + i for i in range(len(batch))], cfg)


def test_fast_graph_replay_equals_eager_bitwise():
    """Eight rows fill the bucket of eight, so eager and replay run the same GEMM shapes."""
    batch = prompts(PROMPT_LENGTHS, SMALL["vocab"])
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40)
    eager = decode("fast", False, batch, cfg, max_batch_size=8)
    graphed = decode("fast", True, batch, cfg, max_batch_size=8)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]


def test_true_on_policy_graphs_padding_and_packed_recompute_bitwise():
    """Five rows replayed in the bucket of eight (three padded rows) give the eager five-row bits, and every
    log-prob equals one packed batch-invariant forward over the whole sequences."""
    batch = prompts(PROMPT_LENGTHS[:5], SMALL["vocab"])
    cfg = SamplingConfig(temperature=0.9, top_k=50, max_new_tokens=40)
    eager = decode("true_on_policy", False, batch, cfg, max_batch_size=8)
    graphed = decode("true_on_policy", True, batch, cfg, max_batch_size=8)
    assert [r.token_ids for r in graphed] == [r.token_ids for r in eager]
    assert [r.logprobs for r in graphed] == [r.logprobs for r in eager]
    recomputed = packed_recompute(batch_invariant_scorer(qwen3(SMALL)), batch, [r.token_ids for r in graphed], 0.9)
    assert [r.logprobs for r in graphed] == recomputed
    # Control: the fast decoder's log-probs of its own samples differ from a batch-invariant recompute.
    fast = decode("fast", True, batch, cfg, max_batch_size=8)
    fast_recomputed = packed_recompute(batch_invariant_scorer(qwen3(SMALL)), batch, [r.token_ids for r in fast], 0.9)
    assert [r.logprobs for r in fast] != fast_recomputed


def _small(family: str) -> torch.nn.Module:
    """SMALL in another family: Qwen2 (q/k/v biases), Llama with every attention bias; no q/k norms."""
    if family == "qwen3":
        return qwen3(SMALL)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls, extra = {"qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
                                    "llama": (LlamaConfig, LlamaForCausalLM, {"attention_bias": True})}[family]
    cfg = config_cls(vocab_size=SMALL["vocab"], hidden_size=SMALL["hidden"], intermediate_size=SMALL["intermediate"],
                     num_hidden_layers=SMALL["layers"], num_attention_heads=SMALL["heads"],
                     num_key_value_heads=SMALL["kv_heads"], head_dim=SMALL["head_dim"], max_position_embeddings=4096,
                     tie_word_embeddings=True, **extra)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(cfg)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            torch.nn.init.normal_(p, std=0.5)  # HF zero-inits biases: make them count
    return model.to(torch.bfloat16).eval().requires_grad_(False)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_fused_decode_step_equals_the_stock_step_bitwise(family):
    """The fused decode forward (services.rollout.embedded.fused_step) against the stock HF forward, graphs on, three
    rows padded into the bucket of eight: the same tokens and log-prob bits."""
    model = _small(family)
    batch = prompts(PROMPT_LENGTHS[:5], SMALL["vocab"])
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40)
    out = {}
    for fused in (True, False):
        decoder = Decoder(model, DecoderOptions(numerics="true_on_policy", cuda_graphs=True, max_batch_size=8,
                                                fused_step=fused))
        assert decoder.decode_forward == ("fused" if fused else "hf")
        out[fused] = [(r.token_ids, r.logprobs) for r in decoder.decode(batch, [100 + i for i in range(5)], cfg)]
        decoder.release()
    assert out[True] == out[False]
    assert len({tuple(t) for t, _ in out[True]}) == 5


def test_throughput_at_the_qwen3_0_6b_shape():
    """256 sequences x 256 new tokens, 128-token prompts, bf16, graphs on: new tokens/s of both modes."""
    n, new, prompt_len = 256, 256, 128
    model = qwen3(QWEN3_0_6B)
    batch = prompts([prompt_len] * n, QWEN3_0_6B["vocab"])
    seeds = list(range(n))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=new)
    report = {}
    for numerics in ("fast", "true_on_policy"):  # fast first: true_on_policy patches the model in place
        decoder = Decoder(model, DecoderOptions(numerics=numerics, max_batch_size=n, cuda_graphs=True,
                                                max_context_tokens=prompt_len + new))
        decoder.decode(batch, seeds, SamplingConfig(temperature=1.0, max_new_tokens=4))  # capture, compile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rows = decoder.decode(batch, seeds, cfg)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.token_ids) for r in rows)
        report[numerics] = {"new_tokens": tokens, "seconds": round(seconds, 3),
                            "new_tokens_per_s": round(tokens / seconds)}
        decoder.release()
    report["true_on_policy_time_over_fast"] = round(report["true_on_policy"]["seconds"] / report["fast"]["seconds"], 3)
    print("decoder throughput " + json.dumps(report))
    assert report["fast"]["new_tokens"] == n * new


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.5), SamplingConfig(temperature=1.7, top_k=40, top_p=0.9)],
                         ids=["plain", "truncated"])
def test_cuda_sampler_draws_what_the_cpu_definition_draws(cfg):
    """The Triton path of sample_tokens (bf16 logits on the GPU) against the torch definition on the CPU."""
    from kernels.sampling import row_keys, seed_words
    from services.rollout.embedded.decoder import sample_tokens

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(64, 151936, generator=g) * 4).to(torch.bfloat16)
    words = seed_words(range(64), torch.device("cpu"))
    want = sample_tokens(logits, cfg, row_keys(words, 9))
    got = sample_tokens(logits.cuda(), cfg, row_keys(words.cuda(), 9))
    # Different log implementations may flip a near-tie; anything beyond a stray row is a real difference.
    assert (got.cpu() == want).float().mean() >= 0.95
