"""bf16 compute over float32 masters: small updates are kept, and bf16 training tracks fp32.

At lr 1e-6 an AdamW update (|update| ~ lr) is far below half a bf16 ulp of a
weight near 0.02 (~6e-5), so bf16 weights would round almost every update
away; float32 masters (ulp ~2e-9 there) keep them. Rollout gets the bf16 cast
of the masters, which is also what forward runs on.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor
from trainer_support import make_episodes, on_policy_request, rollout_logprobs

from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer

pytestmark = pytest.mark.usefixtures("restore_torch_globals")


def _trainer(model_dir, device: str = "cpu", **config) -> Trainer:
    t = Trainer(device=device, num_threads=1)
    t.configure(run_id="run", model_path=str(model_dir), seed=3,
                config_json=json.dumps({"microbatch_tokens": 24, "grad_clip": 0.0, **config}))
    return t


def _request(trainer, model_dir, step: int) -> StepRequest:
    return on_policy_request(trainer, model_dir, step, n_groups=3, per_group=4, seed=100)


def _first_moments(trainer) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg per master (after step 1 it is (1 - beta1) * grad: nonzero exactly where the gradient was)."""
    names = {id(p): n for n, p in trainer.run.policy.lm.named_parameters()}
    out = {}
    for group in trainer.run.optimizer.param_groups:
        for p in group["params"]:
            out[names[id(p)]] = trainer.run.optimizer.state[p]["exp_avg"].full_tensor()
    return out


def test_an_lr_1e6_step_moves_every_master_weight_with_a_gradient(tiny_model_dir, device="cpu"):
    t = _trainer(tiny_model_dir, device, lr=1e-6, dtype="bfloat16")
    before = t.master_state_dict()
    assert {v.dtype for v in before.values()} == {torch.float32}
    t.train_step(_request(t, tiny_model_dir, 1))
    after = t.master_state_dict()
    moments = _first_moments(t)
    with_grad = moved = 0
    for name, m in moments.items():
        has_grad = m != 0
        changed = after[name] != before[name]
        assert changed[has_grad].any(), f"{name}: no master weight with a gradient moved"
        assert not changed[~has_grad].any(), f"{name}: a weight without gradient moved"
        with_grad += int(has_grad.sum())
        moved += int((changed & has_grad).sum())
    assert with_grad > 0.5 * sum(v.numel() for v in before.values())
    assert moved / with_grad >= 0.999
    # The same update applied to bf16 weights would round nearly all of it away: the test can fail.
    as_bf16 = sum(int((after[n].bfloat16() != before[n].bfloat16()).sum()) for n in moments)
    assert as_bf16 / with_grad < 0.1


def test_rollout_gets_the_bf16_cast_of_the_masters(tiny_model_dir, tmp_path, device="cpu"):
    t = _trainer(tiny_model_dir, device, lr=1e-3, dtype="bfloat16")
    t.train_step(_request(t, tiny_model_dir, 1))
    masters = t.master_state_dict()
    streamed = dict(t.weight_tensors("run").tensors)
    assert streamed.keys() <= masters.keys()
    for name, tensor in streamed.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, masters[name].to(torch.bfloat16)), name
    # The checkpoint keeps the float32 masters; its config names the compute dtype.
    path, _ = t.save_checkpoint("run", str(tmp_path / "step_1"))
    stored = load_file(str(path / "model.safetensors"))
    assert all(stored[n].dtype == torch.float32 and torch.equal(stored[n], masters[n].cpu()) for n in stored)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_bf16_training_tracks_fp32_over_20_steps(tiny_model_dir):
    """On-policy, the PPO loss is -mean(advantage) whatever the weights (ratio 1), so the trajectories
    here keep the initial policy's log-probs (off-policy as the run goes on): loss and entropy then
    follow the weights, and bf16 must follow fp32's path."""
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    requests = []
    for step in range(1, 21):
        eps = make_episodes(n_groups=3, per_group=4, seed=100 + step)
        adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
        requests.append([TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]),
                                     torch.tensor(e["response"]),
                                     torch.tensor(rollout_logprobs(initial, e["prompt"], e["response"])),
                                     e["reward"], a) for e, a in zip(eps, adv)])
    runs = {}
    for dtype in ("float32", "bfloat16"):
        # A wide parity gate: step 1 compares bf16 scores with fp32 rollout log-probs on purpose here.
        t = _trainer(tiny_model_dir, lr=1e-3, dtype=dtype,
                     parity_gate={"iw_mean_tolerance": 1.0, "iw_max": 100.0, "logprob_abs_diff_mean": 1.0})
        runs[dtype] = [t.train_step(StepRequest("run", s, s - 1, requests[s - 1])).metrics for s in range(1, 21)]
    # Tolerance: bf16 rounds each op to 2^-9 relative, which puts a token's log-prob of this 2-layer
    # model ~1e-3 off fp32; the loss is a mean of advantage-weighted ratios exp(dlogp), the entropy a
    # mean over tokens, so each stays within a few 1e-3 while the weights follow the same path (measured:
    # loss 4.6e-4, entropy 3.1e-5 over 20 steps). A run whose updates were rounded away would stay at
    # step 1's loss while fp32's moves by ~0.37.
    bounds = {"loss": 5e-3, "entropy": 5e-3}
    for key, bound in bounds.items():
        fp32 = torch.tensor([m[key] for m in runs["float32"]], dtype=torch.float64)
        bf16 = torch.tensor([m[key] for m in runs["bfloat16"]], dtype=torch.float64)
        assert (bf16 - fp32).abs().max() <= bound, (key, (bf16 - fp32).abs().max())
    fp32_loss = [m["loss"] for m in runs["float32"]]
    assert abs(fp32_loss[-1] - fp32_loss[0]) > 0.1  # the weights moved far enough for tracking to mean something


def test_float32_on_one_rank_is_bitwise_a_plain_module(tiny_model_dir):
    """FSDP2 at world size 1 without casts adds nothing to the math: the same step on an unwrapped HF
    model (same microbatches, head, loss, clipping and AdamW) gives the same float32 weights, bit for bit."""
    from transformers import AutoModelForCausalLM

    from kernels.attention import register_hf_attention
    from services.trainer.loss.policy_loss import ppo_clip_token_loss
    from services.trainer.model.policy import score_hidden
    from services.trainer.trainer import build_microbatches

    t = _trainer(tiny_model_dir, lr=1e-2, grad_clip=0.5)
    request = _request(t, tiny_model_dir, 1)
    t.train_step(request)

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32,
                                                 attn_implementation=register_hf_attention()).eval()
    cfg = t.run.config
    optimizer = torch.optim.AdamW(plain.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    microbatches = build_microbatches(request.samples, cfg)
    n_total = sum(mb.num_response_tokens for mb in microbatches)
    for mb in microbatches:
        logp = score_hidden(mb.hidden_states(plain), plain.lm_head.weight, mb.loss_mask, mb.response_targets,
                            temperature=cfg.temperature)[0]
        loss = ppo_clip_token_loss(logp, mb.response_rollout_logprobs, mb.response_advantages,
                                   clip_low=cfg.clip_eps_low, clip_high=cfg.clip_eps_high,
                                   log_ratio_bound=cfg.policy_loss.log_ratio_bound).loss
        (loss.sum() / n_total).backward()
    torch.nn.utils.clip_grad_norm_(list(plain.parameters()), cfg.grad_clip)
    optimizer.step()
    sharded = t.master_state_dict()
    assert all(torch.equal(sharded[k], v) for k, v in plain.state_dict().items())


def test_activation_checkpointing_changes_memory_not_numbers(tiny_model_dir):
    """Recomputing a layer in backward repeats the same deterministic forward: bitwise the same step."""
    results, saved = [], []
    for checkpointing in (False, True):
        t = _trainer(tiny_model_dir, lr=1e-2, dtype="bfloat16", activation_checkpointing=checkpointing)
        request = _request(t, tiny_model_dir, 1)
        mb = t._microbatches(t.run, request.samples)[0]
        sizes: list[int] = []

        def keep(x):
            sizes.append(x.numel() * x.element_size())
            return x

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            t.run.policy(mb)[0].sum().backward()
        t.run.optimizer.zero_grad(set_to_none=True)
        saved.append(sum(sizes))
        results.append((t.train_step(request).metrics, t.master_state_dict()))
    (m0, w0), (m1, w1) = results
    assert m0 == m1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert saved[1] < 0.5 * saved[0]  # the decoder layers' activations were not kept


def test_optimizer_offload_needs_an_accelerator(tiny_model_dir):
    from services.trainer.data.wire import InvalidRequest

    with pytest.raises(InvalidRequest, match="optimizer_offload: .*device 'cpu'"):
        _trainer(tiny_model_dir, optimizer_offload=True)


def test_compiled_layers_train_like_eager_and_rerun_bitwise(tiny_model_dir, device="cpu", dtype="float32"):
    """compile_layers fuses each decoder layer with inductor: the same math to rounding, the same bits run
    to run, one compiled graph serving every layer and every microbatch length.

    Bounds: in float32 only the reduction order differs (loss to 1e-4 relative, weights to 1e-5); in
    bfloat16 the fused kernels round intermediates differently, so the loss agrees to 2e-2 and a weight to
    what two AdamW steps can move it (|update| <= ~lr per step whatever the gradient)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    runs = []
    for compile_layers in (False, True, True):
        t = _trainer(tiny_model_dir, device, lr=1e-3, dtype=dtype, compile_layers=compile_layers)
        metrics = [t.train_step(_request(t, tiny_model_dir, step)).metrics for step in (1, 2)]
        runs.append((metrics, t.master_state_dict()))
    (eager_m, eager_w), (c1_m, c1_w), (c2_m, c2_w) = runs
    assert c1_m == c2_m and all(torch.equal(c1_w[k], c2_w[k]) for k in c1_w)
    loss_rel, weight_abs = (1e-4, 1e-5) if dtype == "float32" else (2e-2, 2 * 2.5e-3)
    for e, c in zip(eager_m, c1_m):
        assert c["loss"] == pytest.approx(e["loss"], rel=loss_rel, abs=1e-6)
    assert max((eager_w[k] - c1_w[k]).abs().max().item() for k in eager_w) < weight_abs
    # Compiled at all (not eager under another name), and not once per layer or per length.
    assert counters["stats"]["unique_graphs"] >= 1
    layers = len(list(t.run.policy.lm.model.layers))
    assert counters["stats"]["unique_graphs"] < 4 * max(layers, 2)


def _count_gathers_and_reductions(monkeypatch) -> tuple[list[int], list[int]]:
    """Every real gather of an FSDP unit (an unshard of a unit not already gathered) and every gradient
    reduction of one, each counted in a list."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    gathers, reductions = [], []
    unshard, foreach_reduce = FSDPParamGroup.unshard, _fsdp_param_group.foreach_reduce

    def counted(self, *args, **kwargs):
        if not self.is_unsharded:
            gathers.append(1)
        return unshard(self, *args, **kwargs)

    def counted_reduce(*args, **kwargs):
        reductions.append(1)
        return foreach_reduce(*args, **kwargs)

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counted_reduce)
    return gathers, reductions


def test_one_rank_gathers_and_reduces_each_unit_once_per_step_with_the_bits_of_doing_it_per_microbatch(
        tiny_model_dir, monkeypatch):
    """A world of one keeps the bf16 weights gathered between a step's microbatches and accumulates their
    gradients unreduced: every unit is cast and gathered, and its gradient reduced, once a step, not once a
    microbatch, and the step is bitwise the one that regathers and reduces each time."""
    from contextlib import contextmanager

    from services.trainer.distributed import sharding

    gathers, reductions = _count_gathers_and_reductions(monkeypatch)
    results = []
    for regather in (False, True):
        t = _trainer(tiny_model_dir, lr=1e-2, dtype="bfloat16")
        request = _request(t, tiny_model_dir, 1)
        passes = len(t._microbatches(t.run, request.samples))
        units = sum(1 for m in t.run.policy.modules() if hasattr(m, "set_reshard_after_backward"))
        if regather:  # the resharding and reduction every microbatch that FSDP does by default
            @contextmanager
            def each_microbatch(root, passes):
                yield lambda index: None

            monkeypatch.setattr(sharding, "gathered_between_microbatches", each_microbatch)
        gathers.clear()
        reductions.clear()
        metrics = t.train_step(request).metrics
        results.append((metrics, t.master_state_dict(), len(gathers), len(reductions)))
        assert all(isinstance(p, DTensor) for p in t.run.policy.parameters())  # the masters registered again
    (m0, w0, gathered, reduced), (m1, w1, regathered, reduced_each) = results
    assert passes >= 3 and units >= 3
    assert gathered == units and regathered == units * passes
    assert reduced == units and reduced_each == units * passes
    assert m0 == m1
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_a_step_that_fails_between_microbatches_leaves_the_masters_registered(tiny_model_dir, monkeypatch):
    """An exception in a later microbatch (here its forward) reshards the units kept gathered, and the next
    step is bitwise the step a fresh trainer takes."""
    from services.trainer.model.policy import PolicyModule

    t = _trainer(tiny_model_dir, lr=1e-2, dtype="bfloat16")
    request = _request(t, tiny_model_dir, 1)
    forward, calls = PolicyModule.forward, []

    def fails_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected in the second microbatch")
        return forward(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(PolicyModule, "forward", fails_second)
        with pytest.raises(RuntimeError, match="injected"):
            t.train_step(request)
    # The decoder layers (kept gathered after the first microbatch) hold their masters again. The root unit's
    # embeddings, norm and head stay gathered after any forward that raises, as they did before this change:
    # the masters did not change, and the next forward uses that gather.
    layers = t.run.policy.lm.model.layers
    assert all(isinstance(p, DTensor) for p in layers.parameters())
    fresh = _trainer(tiny_model_dir, lr=1e-2, dtype="bfloat16")
    assert t.train_step(request).metrics == fresh.train_step(request).metrics
    w, w_fresh = t.master_state_dict(), fresh.master_state_dict()
    assert all(torch.equal(w[k], w_fresh[k]) for k in w)
