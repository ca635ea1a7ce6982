"""Streaming with SGLang: a generate in flight is paused, the weights change, and it is continued.

Against the session's real SGLang server on loopback (CPU, float32), as tests/rollout/sglang/test_sglang_engine.py.
request_pause aborts the call's requests through /pause_generation (mode "abort") and lets the server run
again (/continue_generation); the call returns its unfinished samples as 'paused' with their tokens so far.
After a weight update, the same request with those samples listed as `resumed` continues them under the
new weights. Every token's reported version must be the version that made it, and its log-prob what that
version computes over the whole prefix: the paused tokens under the old weights, the continuation under
the new ones (checked against an fp32 recompute of each).
"""
from __future__ import annotations

import threading

import pytest
import torch

from services.rollout.sglang.weights import load_checkpoint_tensors
from services.rollout.types import GenerationRequest, PromptSpec, ResumedSample, SamplingConfig
from tests.rollout.sglang.test_sglang_engine import EOS, TOL, engine, model_dir, recompute  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

# Long samples (the tiny model's vocabulary is 100 wide, so a sample rarely stops early): the call is still
# decoding when the pause reaches the server, which happens within a few of its decode steps.
PROMPTS = tuple(PromptSpec(f"q{i}", (1, 30 + i, 31 + i), seed=100 * i) for i in range(2))
SAMPLING = SamplingConfig(temperature=0.8, max_new_tokens=64, stop_token_ids=(EOS,))


def generate_paused(engine) -> list:  # noqa: F811
    """Generate with a pause asked until the call returns (as the coordinator's gate asks: a pause sent
    before the requests reached the server finds nothing to abort, so it is asked again)."""
    req = GenerationRequest(prompts=PROMPTS, sampling=SAMPLING, samples_per_prompt=4)
    out: dict = {}
    call = threading.Thread(target=lambda: out.setdefault("samples", engine.generate(req)))
    call.start()
    paused_once = False
    while call.is_alive():
        paused_once |= engine.request_pause()
        call.join(0.05)
    assert paused_once and "samples" in out
    return out["samples"]


def test_a_paused_generate_continues_under_new_weights_with_exact_per_token_versions(engine):  # noqa: F811
    assert engine.request_pause() is False  # nothing in flight: nothing to pause
    old_dir, v = engine.weights_path, engine.policy_version
    # A pause that reaches the server before the first token (or after the last) leaves nothing to continue;
    # the coordinator then starts those samples again, and so does this test.
    for _ in range(5):
        first = generate_paused(engine)
        paused = [s for s in first if s.finish_reason == "paused" and s.token_ids]
        if paused:
            break
    assert paused, [(s.finish_reason, len(s.token_ids)) for s in first]
    for s in first:
        assert s.policy_versions == [v] * len(s.token_ids)
        assert len(s.token_ids) < SAMPLING.max_new_tokens or s.finish_reason == "length"

    old = load_checkpoint_tensors(old_dir)
    g = torch.Generator().manual_seed(v + 7)
    engine.update_weights({k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in old.items()}, v + 1)
    new_dir = engine.weights_path

    resumed = tuple(ResumedSample(s.sample_id, tuple(s.token_ids), tuple(s.logprobs), tuple(s.policy_versions))
                    for s in paused)
    second = engine.generate(GenerationRequest(prompts=PROMPTS, sampling=SAMPLING, samples_per_prompt=4,
                                               resumed=resumed))
    by_id = {s.sample_id: s for s in second}
    prompt_of = {p.group_id: p.token_ids for p in PROMPTS}
    kept_gaps, new_gaps, wrong_gaps = [], [], []
    for before in paused:
        after = by_id[before.sample_id]
        n = len(before.token_ids)
        assert after.finish_reason in ("stop", "length") and len(after.token_ids) > n
        assert after.token_ids[:n] == before.token_ids and after.logprobs[:n] == before.logprobs
        assert after.policy_versions == [v] * n + [v + 1] * (len(after.token_ids) - n)
        prompt, lp = prompt_of[after.group_id], torch.tensor(after.logprobs)
        kept_gaps.append((lp[:n] - recompute(old_dir, prompt, after.token_ids[:n], 0.8)).abs())
        full_new = recompute(new_dir, prompt, after.token_ids, 0.8)
        new_gaps.append((lp[n:] - full_new[n:]).abs())
        wrong_gaps.append((lp[n:] - recompute(old_dir, prompt, after.token_ids, 0.8)[n:]).abs())
    kept, new, wrong = torch.cat(kept_gaps), torch.cat(new_gaps), torch.cat(wrong_gaps)
    print(f"\n{len(paused)} paused samples; mean |dlogp| paused tokens vs old weights {kept.mean():.2e}, "
          f"continuation vs new weights {new.mean():.2e} ({new.numel()} tokens), vs old {wrong.mean():.2e}")
    assert kept.mean().item() <= TOL and new.mean().item() <= TOL
    # Control: the continuation is not the old weights' (so its version label could be wrong and fail here).
    assert wrong.mean().item() > 100 * TOL
