"""The embedded torch engine against a full-sequence teacher-forced recompute.

The model is a tiny stock Qwen3 built here (GQA, 2 layers), initialised with a
large std so its distributions are far from uniform: a position-id or mask bug
then moves log-probs by much more than the 1e-5 tolerance (a control test
checks exactly that, so the parity test can fail).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kernels.logprob import token_logprobs
from kernels.sampling import truncate_logits
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.types import GenerationRequest, PromptSpec, SamplingConfig

VOCAB = 32
PARITY_TOL = 1e-5


def build_tiny_qwen3(path: Path, *, seed: int = 0) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        initializer_range=0.3, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    return path


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="module")
def engine(model_dir) -> TorchEngine:
    e = TorchEngine(TorchEngineConfig(dtype="float32", device="cpu", max_batch_size=64))
    e.load(str(model_dir), policy_version=0)
    return e


PROMPTS = (
    PromptSpec("short", (3,), seed=11),
    PromptSpec("long", (1, 2, 3, 4, 5, 6, 7, 8, 9), seed=1000),
    PromptSpec("mid", (5, 9, 2, 30), seed=77),
)


def request(prompts=PROMPTS, n: int = 3, **sampling) -> GenerationRequest:
    base = dict(temperature=0.7, max_new_tokens=10)
    return GenerationRequest(prompts=tuple(prompts), sampling=SamplingConfig(**{**base, **sampling}), samples_per_prompt=n)


def recompute(engine: TorchEngine, prompt, response, temperature: float, *, attended_pads: int = 0) -> torch.Tensor:
    """One forward over prompt+response (no padding, no cache) scored at `temperature`.

    `attended_pads` > 0 prepends that many pad tokens WITHOUT masking them:
    the classic left-padding bug, used as a control.
    """
    ids = torch.tensor([[0] * attended_pads + list(prompt) + list(response)])
    with torch.no_grad():
        logits = engine._model(input_ids=ids).logits[0, attended_pads:]
    scored = logits[len(prompt) - 1 : -1]
    logp, _ = token_logprobs(scored, torch.tensor(response), temperature=temperature)
    return logp


def max_gap(engine: TorchEngine, req: GenerationRequest, samples) -> float:
    by_group = {p.group_id: p for p in req.prompts}
    gap = 0.0
    for s in samples:
        ref = recompute(engine, by_group[s.group_id].token_ids, s.token_ids, req.sampling.logprob_temperature)
        gap = max(gap, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return gap


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_p=0.8, top_k=10),  # truncation is not part of the scored distribution
        dict(greedy=True),  # scored at temperature 1
    ],
    ids=["t0.7", "t1.3-topp-topk", "greedy"],
)
def test_logprobs_equal_teacher_forced_recompute(engine, sampling):
    req = request(**sampling)
    samples = engine.generate(req)
    assert len(samples) == len(PROMPTS) * 3
    assert all(len(s.token_ids) == len(s.logprobs) >= 1 for s in samples)
    gap = max_gap(engine, req, samples)
    print(f"engine vs recompute max |dlogp| ({sampling}): {gap:.3e}")
    assert gap <= PARITY_TOL


def test_parity_check_detects_attended_padding(engine):
    """Control: the same check against a forward that attends to left padding fails by far.

    (A uniform position shift would not do as a control: RoPE only sees
    relative positions, so it changes nothing but rounding.)
    """
    req = request(prompts=PROMPTS[:1], n=1)
    (s,) = engine.generate(req)
    right = recompute(engine, PROMPTS[0].token_ids, s.token_ids, 0.7)
    wrong = recompute(engine, PROMPTS[0].token_ids, s.token_ids, 0.7, attended_pads=8)
    assert (right - torch.tensor(s.logprobs)).abs().max() <= PARITY_TOL
    assert (wrong - torch.tensor(s.logprobs)).abs().max() > 1e-3


def test_same_request_same_bits(engine):
    a, b = engine.generate(request()), engine.generate(request())
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]  # exact float equality
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]


def test_output_order_and_ids(engine):
    samples = engine.generate(request(n=2))
    assert [(s.group_id, s.index) for s in samples] == [(p.group_id, i) for p in PROMPTS for i in range(2)]
    assert samples[1].sample_id == "short/1"


def test_samples_do_not_depend_on_batch_composition(model_dir):
    """A prompt's samples are the same alone, batched with longer/shorter prompts, or in micro-batches of 1."""
    big = TorchEngine(TorchEngineConfig(max_batch_size=64))
    big.load(str(model_dir), 0)
    small = TorchEngine(TorchEngineConfig(max_batch_size=1))
    small.load(str(model_dir), 0)
    target = PROMPTS[2]
    alone = big.generate(request(prompts=[target]))
    mixed = [s for s in big.generate(request()) if s.group_id == target.group_id]
    one_by_one = [s for s in small.generate(request()) if s.group_id == target.group_id]
    for other in (mixed, one_by_one):
        assert [s.token_ids for s in other] == [s.token_ids for s in alone]
        # Different padding changes GEMM shapes, so only tokens are promised bitwise here.
        for x, y in zip(other, alone):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= PARITY_TOL


def test_sample_i_uses_seed_plus_i(engine):
    p = PROMPTS[1]
    three = engine.generate(request(prompts=[p], n=3))
    shifted = engine.generate(request(prompts=[dataclasses.replace(p, seed=p.seed + 1)], n=1))
    assert shifted[0].token_ids == three[1].token_ids
    # ...and the seed matters: three samples of one prompt are not all the same.
    assert len({tuple(s.token_ids) for s in three}) > 1


def test_stop_ids_end_the_sample_and_are_included(engine):
    stops = (1, 2)
    req = request(n=4, temperature=1.0, max_new_tokens=12, stop_token_ids=stops)
    samples = engine.generate(req)
    reasons = {s.finish_reason for s in samples}
    assert reasons == {"stop", "length"}, reasons  # the request is chosen to produce both
    for s in samples:
        body = s.token_ids[:-1]
        assert not set(body) & set(stops)
        if s.finish_reason == "stop":
            assert s.token_ids[-1] in stops and len(s.token_ids) <= 12
        else:
            assert len(s.token_ids) == 12 and s.token_ids[-1] not in stops
    # A finished sample's neighbours keep generating correctly (finished rows are masked, not corrupting).
    assert max_gap(engine, req, samples) <= PARITY_TOL


def test_top_k_1_equals_greedy(engine):
    greedy = engine.generate(request(greedy=True, temperature=1.0))
    top1 = engine.generate(request(top_k=1, temperature=1.0))
    assert [s.token_ids for s in top1] == [s.token_ids for s in greedy]
    assert [s.logprobs for s in top1] == [s.logprobs for s in greedy]


def test_truncate_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda out: torch.isfinite(out[0]).nonzero().flatten().tolist()  # noqa: E731
    assert kept(truncate_logits(logits, 2, 1.0)) == [1, 3]
    assert kept(truncate_logits(logits, 0, 0.79)) == [1, 3]
    assert kept(truncate_logits(logits, 0, 0.81)) == [1, 2, 3]
    assert kept(truncate_logits(logits, 0, 0.1)) == [1]  # the most likely token always survives
    assert kept(truncate_logits(logits, 3, 0.5)) == [1]
    # Kept logits are unchanged (truncation only removes).
    out = truncate_logits(logits, 0, 0.81)
    assert torch.equal(out[0, [1, 2, 3]], logits[0, [1, 2, 3]])


def test_top_p_samples_only_from_the_nucleus(engine):
    """Every sampled token is inside the top-p set of the distribution it was drawn from."""
    req = request(n=6, temperature=1.0, top_p=0.5, max_new_tokens=6)
    by_group = {p.group_id: p for p in req.prompts}
    for s in engine.generate(req):
        ids = torch.tensor([list(by_group[s.group_id].token_ids) + s.token_ids])
        with torch.no_grad():
            logits = engine._model(input_ids=ids).logits[0, len(by_group[s.group_id].token_ids) - 1 : -1]
        nucleus = torch.isfinite(truncate_logits(logits, 0, 0.5))
        assert all(nucleus[t, tok] for t, tok in enumerate(s.token_ids))


# --------------------------------------------------------------------- weights --


def perturbed(engine: TorchEngine, scale: float = 0.05) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return {n: t.detach() + scale * torch.randn(t.shape, generator=g) for n, t in engine._model.state_dict().items()}


def snapshot(engine: TorchEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine._model.state_dict().items()}


def test_update_weights_applies_and_bumps_version(model_dir):
    e = TorchEngine(TorchEngineConfig())
    e.load(str(model_dir), 0)
    req = request(greedy=True)
    before = e.generate(req)
    new = perturbed(e)
    e.update_weights(new, policy_version=1)
    assert e.policy_version == 1
    assert all(torch.equal(e._model.state_dict()[n], t) for n, t in new.items())
    after = e.generate(req)
    assert [s.logprobs for s in after] != [s.logprobs for s in before]
    assert max_gap(e, req, after) <= PARITY_TOL  # still agrees with a recompute under the new weights
    e.update_weights(new, policy_version=1)  # same version, same weights: no-op
    assert e.policy_version == 1
    with pytest.raises(ValueError, match="policy_version: 1 is already loaded with different weights"):
        e.update_weights(perturbed(e, 0.01), policy_version=1)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda w: w.update({"model.norm.weight": torch.ones(7)}), r"model\.norm\.weight: shape \(7,\)"),
        (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].double()}), "dtype torch.float64"),
        (lambda w: w.pop("lm_head.weight"), "lm_head.weight: missing from the update"),
        (lambda w: w.update({"model.extra.weight": torch.ones(1)}), "model.extra.weight: not a tensor of the loaded model"),
        (lambda w: w["model.layers.1.mlp.up_proj.weight"].view(-1)[5].fill_(float("nan")), "non-finite"),
    ],
    ids=["shape", "dtype", "missing", "unknown", "nan"],
)
def test_update_weights_refuses_and_applies_nothing(model_dir, corrupt, message):
    e = TorchEngine(TorchEngineConfig())
    e.load(str(model_dir), 0)
    before = snapshot(e)
    new = perturbed(e)
    corrupt(new)
    with pytest.raises(ValueError, match=message):
        e.update_weights(new, policy_version=1)
    assert e.policy_version == 0
    assert all(torch.equal(e._model.state_dict()[n], t) for n, t in before.items())


# ---------------------------------------------------------- config, validation --


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"dtyp": "float32"}', "engine_config.dtyp"),
        ('{"dtype": "float8"}', "engine_config.dtype"),
        ('{"max_batch_size": 0}', "engine_config.max_batch_size"),
        ('{"logprob_backend": "magic"}', "engine_config.logprob_backend"),
        ("[1, 2]", "expected a JSON object"),
        ("{nope", "not valid JSON"),
    ],
)
def test_engine_config_errors_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        TorchEngineConfig.from_json(text)


def test_engine_config_defaults_and_docs():
    assert TorchEngineConfig.from_json("") == TorchEngineConfig()
    assert TorchEngineConfig.from_json('{"dtype": "bfloat16", "max_batch_size": 8}').max_batch_size == 8
    assert all(f.description for f in TorchEngineConfig.model_fields.values())


@pytest.mark.parametrize(
    "req, message",
    [
        (request(prompts=[PromptSpec("a", (1, 99), 0)]), r"prompts\[0\]\.token_ids: id 99 outside the vocabulary"),
        (request(prompts=[PROMPTS[0], PromptSpec("b", (), 0)]), r"prompts\[1\]\.token_ids: empty"),
        (request(stop_token_ids=(40,)), "sampling.stop_token_ids: id 40"),
        (request(max_new_tokens=60), "sampling.max_new_tokens: prompts.1. has 9 tokens"),
        (request(top_p=1.5), "sampling.top_p"),
        (request(n=0), "samples_per_prompt"),
    ],
    ids=["vocab", "empty", "stop", "context", "top_p", "n"],
)
def test_generate_validation_names_the_field(engine, req, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(req)


def test_generate_without_model_fails_loud():
    with pytest.raises(RuntimeError, match="no model loaded"):
        TorchEngine().generate(request())
