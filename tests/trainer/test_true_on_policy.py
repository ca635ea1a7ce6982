"""numerics 'true_on_policy' through the trainer's real scoring path: log-probs bitwise equal to the sampler's.

The "rollout" here is a plain sampling loop over the patched model (kernels/batch_invariant/hf.py) holding
the weights the trainer would stream (`current_policy`): every new token recomputes the whole sequence (no
KV cache), all prompts of the batch packed into one buffer, and the sampled token is scored with
kernels.logprob.token_logprobs, the call the embedded engine makes. The trainer then scores those
trajectories with its own packing at several microbatch budgets (other neighbours in every buffer): each
token's logp must be the loop's bits, in float32 and in bfloat16, and the step-1 gate demands exactly that.
"""
from __future__ import annotations

import pytest
import torch

from kernels.attention import REGISTRY, register_hf_attention
from kernels.attention.hf import packed_forward_kwargs
from kernels.batch_invariant.hf import make_batch_invariant
from recipes.tiny_model import TinyQwen3Config, build_model_dir
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.model.policy import score_hidden, score_hidden_batch_invariant
from services.trainer.trainer import Trainer
from trainer_support import current_policy

SMALL = TinyQwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, initializer_range=0.2)
TEMPERATURE = 0.8


@pytest.fixture(autouse=True)
def restore_attention_policy():
    """A true_on_policy Trainer forces the process-wide registry onto 'batch_invariant'; later tests
    that select automatically must not inherit that."""
    saved = REGISTRY.policy
    yield
    REGISTRY.set_policy(saved)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model_dir(tmp_path_factory.mktemp("tiny_bi") / "m", SMALL, seed=5)


def _configure(trainer: Trainer, model_dir, run_id: str, dtype: str, budget: int, **extra) -> None:
    import json

    trainer.configure(run_id=run_id, model_path=str(model_dir), seed=7, config_json=json.dumps({
        "numerics": "true_on_policy", "dtype": dtype, "microbatch_tokens": budget, "temperature": TEMPERATURE,
        **extra}))


@torch.no_grad()
def sample_full_recompute(model, prompts: list[list[int]], new_tokens: list[int], *, device="cpu", seed=0):
    """Sample every prompt's continuation, recomputing all sequences in one packed forward per token.

    Returns (responses, rollout log-probs) as the engine reports them: log_softmax(logits / T) of the
    sampled token over the full vocabulary, by kernels.logprob.token_logprobs (backend 'auto')."""
    from kernels.logprob import token_logprobs

    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(prompts))]  # sampling on the CPU
    seqs = [list(p) for p in prompts]
    logps: list[list[float]] = [[] for _ in prompts]
    for step in range(max(new_tokens)):
        live = [i for i, n in enumerate(new_tokens) if step < n]
        ids = torch.tensor([t for i in live for t in seqs[i]], device=device)
        lengths = torch.tensor([len(seqs[i]) for i in live])
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()]).to(device)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32).to(device)
        with REGISTRY.forced("batch_invariant"):
            logits = model(input_ids=ids[None], use_cache=False,
                           **packed_forward_kwargs(positions, cu, int(lengths.max()))).logits[0]
        last = logits[cu[1:].long() - 1]  # each live sequence's last position
        for j, i in enumerate(live):
            probs = torch.softmax(last[j].float().cpu() / TEMPERATURE, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=gens[i]))
            logp, _ = token_logprobs(last[j:j + 1], torch.tensor([token], device=device), temperature=TEMPERATURE)
            seqs[i].append(token)
            logps[i].append(float(logp[0]))
    return [s[len(p):] for s, p in zip(seqs, prompts)], logps


def _rollout_model(trainer: Trainer, model_dir, device="cpu"):
    if trainer.run.config.lora is None:
        model = current_policy(trainer, model_dir, device=device)  # the compute-dtype cast the trainer streams
    else:  # before the first update a LoRA policy is its base model (B = 0)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval().to(device)
    model.set_attn_implementation(register_hf_attention())
    return make_batch_invariant(model)


def _request(trainer: Trainer, model_dir, *, device="cpu", n=6, seed=0) -> StepRequest:
    g = torch.Generator().manual_seed(seed)
    vocab = int(trainer.run.vocab_size)
    longest = 9 if n <= 8 else 40
    prompts = [torch.randint(3, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    new = [int(torch.randint(1, longest, (1,), generator=g)) for _ in range(n)]
    responses, logps = sample_full_recompute(_rollout_model(trainer, model_dir, device), prompts, new,
                                             device=device, seed=seed)
    samples = [TrainSample(f"g{i // 3}/{i % 3}", f"g{i // 3}", torch.tensor(p), torch.tensor(r),
                           torch.tensor(lp, dtype=torch.float32), float(i % 2), float(i % 2) - 0.5)
               for i, (p, r, lp) in enumerate(zip(prompts, responses, logps))]
    return StepRequest(trainer.run.run_id, 1, 0, samples)


def check_bitwise_at_every_packing(model_dir, dtype: str, *, device: str = "cpu", n: int = 6) -> None:
    """Sample with the loop, score with the trainer at three microbatch budgets, then train step 1."""
    trainer = Trainer(device=device, num_threads=1)
    _configure(trainer, model_dir, "probe", dtype, 1 << 16)
    request = _request(trainer, model_dir, device=device, n=n)
    total = sum(s.num_tokens - 1 for s in request.samples)
    longest = max(s.num_tokens for s in request.samples)
    # One sequence per microbatch, a few per microbatch, all in one: each token sees other neighbours.
    for budget in (longest, max(longest, total // 3), total):
        _configure(trainer, model_dir, f"b{budget}", dtype, budget)
        verdict = trainer.check_parity(StepRequest(trainer.run.run_id, 1, 0, request.samples))
        assert verdict.passed, verdict.message()
        assert verdict.numerics == "true_on_policy" and verdict.attention_backend == "batch_invariant"
        assert verdict.stats["logprob_abs_diff_max"] == 0.0 and verdict.stats["tokens"] > 2 * n
    # A training step: the gate (with gradients on) passes and every importance weight is exactly 1.
    outcome = trainer.train_step(StepRequest(trainer.run.run_id, 1, 0, request.samples))
    m = outcome.metrics
    assert m["iw_min"] == m["iw_max"] == m["iw_mean"] == 1.0 and m["logprob_abs_diff_max"] == 0.0
    assert m["grad_norm"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_equal_the_samplers_bits_at_every_packing(model_dir, dtype, restore_torch_globals):
    check_bitwise_at_every_packing(model_dir, dtype, n=12)


def test_a_lora_run_is_bitwise_too(model_dir, restore_torch_globals):
    trainer = Trainer(device="cpu", num_threads=1)
    _configure(trainer, model_dir, "lora", "float32", 40, lora={"rank": 4, "alpha": 8.0})
    adapters = [m for n, m in trainer.run.policy.lm.named_modules() if n.endswith(".lora_A.default")]
    assert adapters and all("forward" in m.__dict__ for m in adapters)  # patched after injection
    # B = 0 before the first update: the adapted model computes the base model's bits.
    verdict = trainer.check_parity(_request(trainer, model_dir, seed=3))
    assert verdict.passed and verdict.stats["logprob_abs_diff_max"] == 0.0, verdict.message()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_batch_invariant_head_is_chunking_invariant_with_gradients_like_the_fast_head(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(50, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    mask = torch.rand(37, generator=g) > 0.3
    targets = torch.randint(0, 50, (int(mask.sum()),), generator=g)
    whole = score_hidden_batch_invariant(hidden, weight, mask, targets, temperature=TEMPERATURE)
    for chunk in (1, 5, 1000):
        parts = score_hidden_batch_invariant(hidden, weight, mask, targets, temperature=TEMPERATURE, chunk_rows=chunk)
        assert all(torch.equal(a, b) for a, b in zip(whole, parts))
    (whole[0].sum() + whole[2].sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    fast = score_hidden(hidden.float(), weight.float(), mask, targets, temperature=TEMPERATURE)
    (fast[0].sum() + fast[2].sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for a, b in zip(whole, fast):
        assert torch.allclose(a, b, atol=tol * 10, rtol=tol)
    for a, b in zip(grads, (hidden.grad, weight.grad)):
        assert torch.allclose(a.float(), b.float(), atol=tol * 10, rtol=tol)


def test_a_model_true_on_policy_cannot_run_is_refused_at_configure(tmp_path, restore_torch_globals):
    from recipes.char_tokenizer import CharVocab
    from recipes.tiny_model import build_tiny_qwen3, save_model_dir
    from services.trainer.data.wire import InvalidRequest

    model = build_tiny_qwen3(SMALL, seed=0)
    model.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    path = save_model_dir(model, tmp_path / "linear_rope", CharVocab())
    with pytest.raises(InvalidRequest, match="trainer_config_json.numerics: 'true_on_policy' cannot run this model: "
                                             "config.rope_parameters.rope_type"):
        _configure(Trainer(device="cpu", num_threads=1), path, "r", "float32", 64)


def test_the_kl_reference_scores_with_the_same_bits(model_dir, restore_torch_globals):
    trainer = Trainer(device="cpu", num_threads=1)
    _configure(trainer, model_dir, "kl", "bfloat16", 64, kl_coef=0.1)
    ref = trainer.run.ref_model
    assert ref.numerics == "true_on_policy"
    assert all("forward" in m.__dict__ for m in ref.lm.modules() if type(m) is torch.nn.Linear)
    # At step 1 policy and reference hold the same bf16 weights and run the same batch-invariant
    # forward: the k3 KL to the reference is exactly 0, not merely small.
    outcome = trainer.train_step(_request(trainer, model_dir, seed=4))
    assert outcome.metrics["kl_ref"] == 0.0 and outcome.metrics["iw_max"] == 1.0


def test_a_data_parallel_group_scores_the_samplers_bits(model_dir, restore_torch_globals):
    from services.trainer.distributed.worker_group import GroupSpec, GroupTrainer

    group = GroupTrainer(GroupSpec(world_size=2, device="cpu", num_threads=1, timeout_s=120))
    try:
        # A small budget: several microbatches, spread over both ranks, each a forward of the shards.
        _configure(group, model_dir, "dp", "bfloat16", 24)
        request = _request(group, model_dir, n=8, seed=6)
        verdict = group.check_parity(request)
        assert verdict.passed and verdict.stats["logprob_abs_diff_max"] == 0.0, verdict.message()
        metrics = group.train_step(request).metrics
        assert metrics["iw_min"] == metrics["iw_max"] == 1.0
    finally:
        group.close()
