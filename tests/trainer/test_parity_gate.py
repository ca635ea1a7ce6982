"""Step-1 parity gate: thresholds, diagnostics, and the packed-attention failure reproduced end to end on a tiny Qwen3."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from kernels.attention import REGISTRY, register_hf_attention
from services.trainer.data.packing import PackingConfig, PackSample, pack_samples
from services.trainer.parity_gate import ParityGateError, ParityThresholds, check_parity
from tests.support.boundary_blind_attention import backend as boundary_blind_backend
from tests.support.rounding_bounds import response_logprob_bounds


def _gate(delta, **kw):
    n = delta.numel()
    rollout = -torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    kw.setdefault("sample_index", torch.arange(n) // 10)
    kw.setdefault("positions", torch.arange(n) % 10 + 3)
    return check_parity((rollout + delta).float(), rollout.float(), attention_backend="attn_x",
                        logprob_backend="lp_y", **kw)


def test_identical_logprobs_pass_with_iw_exactly_one():
    v = _gate(torch.zeros(1000, dtype=torch.float64))
    assert v.passed and v.failures == ()
    assert v.stats["iw_mean"] == v.stats["iw_min"] == v.stats["iw_max"] == 1.0
    assert v.stats["logprob_abs_diff_max"] == 0.0 and v.stats["tokens"] == 1000
    assert "PASSED" in v.message() and "attention backend: attn_x; logprob backend: lp_y" in v.message()
    v.raise_if_failed()


def test_small_numerical_noise_passes():
    noise = torch.randn(5000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-3
    assert _gate(noise).passed


def test_iw_mean_bound_alone():
    v = _gate(torch.full((1000,), 0.01, dtype=torch.float64))  # IW = e^0.01 everywhere
    assert not v.passed
    assert len(v.failures) == 1 and v.failures[0].startswith("|IW mean - 1| = 0.01005 > 0.001")


def test_iw_max_bound_alone():
    d = torch.zeros(20000, dtype=torch.float64)
    d[123] = math.log(5.0)  # one token 5x more likely under the trainer: mean moves by 2e-4 only
    v = _gate(d)
    assert len(v.failures) == 1 and v.failures[0] == "IW max = 5 > 3"
    assert v.worst[0].sample == 12 and v.worst[0].position == 123 % 10 + 3
    assert v.worst[0].iw == pytest.approx(5.0)


def test_logprob_diff_bound_alone():
    d = torch.tensor([0.04, -0.04] * 500, dtype=torch.float64)  # IW mean = cosh(0.04) = 1.0008
    v = _gate(d)
    assert len(v.failures) == 1 and v.failures[0].startswith("mean |logp - rollout_logp| = 0.04 > 0.03")


def test_non_finite_fails_and_ranks_first():
    d = torch.zeros(100, dtype=torch.float64)
    d[7] = float("nan")
    v = _gate(d)
    assert not v.passed and "1 response tokens have a non-finite" in v.failures[0]
    assert math.isnan(v.worst[0].logp) and v.worst[0].sample == 0 and v.worst[0].position == 10


def test_loss_mask_selects_tokens_and_custom_thresholds_apply():
    d = torch.zeros(100, dtype=torch.float64)
    d[50:] = 5.0
    mask = torch.zeros(100, dtype=torch.bool)
    mask[:50] = True
    assert _gate(d, loss_mask=mask).passed
    assert not _gate(d).passed
    loose = ParityThresholds(iw_mean_tolerance=1e6, iw_max=1e6, logprob_abs_diff_mean=10.0, worst_tokens=2)
    v = _gate(d, thresholds=loose)
    assert v.passed and len(v.worst) == 2


def test_worst_tokens_are_ordered_and_named():
    d = torch.zeros(30, dtype=torch.float64)
    d[[4, 17, 25]] = torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64)
    v = _gate(d, sample_ids=["a", "b", "c"], thresholds=ParityThresholds(worst_tokens=3))
    assert [(w.sample_id, w.position) for w in v.worst] == [("b", 10), ("c", 8), ("a", 7)]
    assert "sample 1 (b) position 10" in v.message()


def test_misaligned_inputs_are_refused():
    with pytest.raises(ValueError, match="positions must be 1-D with 4 entries"):
        check_parity(torch.zeros(4), torch.zeros(4), sample_index=torch.zeros(4, dtype=torch.long),
                     positions=torch.zeros(3, dtype=torch.long), attention_backend="a", logprob_backend="b")
    with pytest.raises(ValueError, match="no response tokens"):
        check_parity(torch.zeros(4), torch.zeros(4), sample_index=torch.zeros(4, dtype=torch.long),
                     positions=torch.zeros(4, dtype=torch.long), loss_mask=torch.zeros(4, dtype=torch.bool),
                     attention_backend="a", logprob_backend="b")


def test_thresholds_are_typed_documented_and_default_to_the_issue():
    t = ParityThresholds()
    assert (t.iw_mean_tolerance, t.iw_max, t.logprob_abs_diff_mean) == (1e-3, 3.0, 0.03)
    for name, f in ParityThresholds.model_fields.items():
        assert f.description, name
    with pytest.raises(ValueError):
        ParityThresholds(iw_max=0.5)
    with pytest.raises(ValueError):
        ParityThresholds(iw_mean_tol=1.0)


# ---- the packed-attention failure, reproduced ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def step1():
    """A tiny Qwen3 'rollout engine' (HF sdpa, one sequence at a time) samples trajectories and reports
    their log-probs; the trainer holds the same weights and runs the packed path."""
    import transformers

    from kernels.logprob import token_logprobs

    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
        initializer_range=0.2)  # large enough init that a token's distribution depends on its context
    torch.manual_seed(0)
    engine = transformers.Qwen3ForCausalLM(cfg).float().eval()
    engine.set_attn_implementation("sdpa")
    trainer = copy.deepcopy(engine)
    trainer.set_attn_implementation(register_hf_attention())

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 256, (12, 3), generator=g)
    torch.manual_seed(1)
    with torch.no_grad():
        seqs = engine.generate(prompts, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=45,
                               min_new_tokens=45, pad_token_id=0)
    samples = []
    for i, seq in enumerate(seqs):
        # Any split of a sampled sequence is a valid (prompt, response): varied lengths for packing.
        p, r = 3 + (i * 5) % 17, 5 + (i * 11) % 26
        with torch.no_grad():
            logits = engine(input_ids=seq[None, :p + r]).logits[0]
        rollout = token_logprobs(logits[p - 1:p + r - 1], seq[p:p + r], backend="reference")[0]
        samples.append(PackSample(seq[:p].tolist(), seq[p:p + r].tolist(), rollout.tolist(), 1.0, f"g{i}/0"))
    return trainer, samples


def _run_gate(trainer, samples, backend):
    from kernels.logprob import token_logprobs

    mbs = pack_samples(samples, PackingConfig(token_budget=256))
    assert any(mb.num_sequences > 1 for mb in mbs)  # packing actually happened
    REGISTRY.reset_usage()
    parts = []
    with torch.no_grad(), REGISTRY.forced(backend):
        for mb in mbs:
            lp = token_logprobs(trainer.lm_head(mb.hidden_states(trainer))[mb.loss_mask], mb.response_targets, backend="reference")[0]
            parts.append((lp, mb.response_rollout_logprobs, mb.response_sample_index, mb.response_positions))
    cat = [torch.cat(x) for x in zip(*parts)]
    return check_parity(cat[0], cat[1], sample_index=cat[2], positions=cat[3],
                        attention_backend=",".join(sorted(REGISTRY.usage())), logprob_backend="reference",
                        sample_ids=[s.sample_id for s in samples])


def test_reference_attention_passes_the_gate(step1):
    verdict = _run_gate(*step1, "reference")
    assert verdict.passed, verdict.message()
    # Same weights, same per-sequence SDPA call, same log-prob kernel: what is left is rounding (the
    # CPU GEMM gives a row other bits inside a [T, K] product than inside an [L, K] one), bounded from
    # float32's unit roundoff and this model's own values, not from one machine's kernels.
    trainer, samples = step1
    bound = response_logprob_bounds(trainer, [(s.prompt_ids, s.response_ids) for s in samples])
    assert verdict.stats["logprob_abs_diff_max"] <= bound.max().item()
    # |mean(e^d) - 1| <= mean(e^|d| - 1), and the gate reduces in float64.
    assert abs(verdict.stats["iw_mean"] - 1.0) <= torch.expm1(bound).mean().item()
    # Worst-case rounding is still an order of magnitude under what a leak across packed sequences
    # costs (the next test: mean |dlogp| > 0.3), so these bounds would catch one.
    assert bound.mean().item() < 0.3 / 10, bound.mean().item()
    assert verdict.attention_backend == "reference"


def test_boundary_blind_attention_is_stopped_at_step_1_naming_it(step1):
    # Mis-declared as honouring boundaries: the registry cannot know, so this is the gate's catch.
    REGISTRY.register(boundary_blind_backend(honours_boundaries=True))
    try:
        verdict = _run_gate(*step1, "test_boundary_blind")
    finally:
        REGISTRY.unregister("test_boundary_blind")
    assert not verdict.passed
    s = verdict.stats
    assert abs(s["iw_mean"] - 1) > 10 * 1e-3 and s["iw_max"] > 3 and s["logprob_abs_diff_mean"] > 0.3
    assert len(verdict.failures) == 3
    with pytest.raises(ParityGateError, match="attention backend: test_boundary_blind") as exc:
        verdict.raise_if_failed()
    # The worst tokens point into sequences that were packed behind another one (the first sequence of
    # each microbatch has nothing before it to leak from, so it is unaffected).
    first_in_mb = {mb.samples[0] for mb in pack_samples(step1[1], PackingConfig(token_budget=256))}
    assert all(w.sample not in first_in_mb for w in verdict.worst)
    assert "worst tokens" in str(exc.value)
    print(verdict.message())
