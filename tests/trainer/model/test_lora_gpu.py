"""LoRA on one GPU in bf16 (gpu marker): adapters train over FSDP2 on a one-rank NCCL group, the base stays
bit for bit the model's, reruns are bitwise, eager and compiled layers agree to bf16 rounding."""
from __future__ import annotations

import json

import pytest
import torch
from test_lora import LORA, base_weights
from trainer_support import make_episodes

from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import StepRequest
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
    pytest.mark.usefixtures("restore_torch_globals"),
]


def _request(step: int) -> StepRequest:
    eps = make_episodes(seed=40 + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    # Off-policy log-probs on purpose: the ratio is not 1, so the loss has a gradient either way.
    samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                           torch.full((len(e["response"]),), -2.0), e["reward"], a) for e, a in zip(eps, adv)]
    return StepRequest("run", step, step - 1, samples)


def _run(model_dir, *, compile_layers: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    t = Trainer(device="cuda", num_threads=1)
    t.configure(run_id="run", model_path=str(model_dir), seed=5, config_json=json.dumps({
        "lr": 1e-2, "microbatch_tokens": 24, "dtype": "bfloat16", "lora": LORA, "compile_layers": compile_layers,
        "parity_gate": {"iw_mean_tolerance": 1e9, "iw_max": 1e30, "logprob_abs_diff_mean": 1e9}}))
    metrics = [t.train_step(_request(s)).metrics for s in (1, 2)]
    return metrics, {k: v.cpu() for k, v in t.master_state_dict().items()}


def test_lora_bf16_on_gpu_trains_only_adapters_and_reruns_bitwise(tiny_model_dir):
    (m1, w1), (m2, w2) = _run(tiny_model_dir, compile_layers=False), _run(tiny_model_dir, compile_layers=False)
    assert m1 == m2 and all(torch.equal(w1[k], w2[k]) for k in w1)
    for name, value in base_weights(tiny_model_dir).items():
        key = name.replace(".weight", ".base_layer.weight")
        assert torch.equal(w1[key if key in w1 else name], value), name
    assert any(v.abs().sum() > 0 for k, v in w1.items() if ".lora_B." in k)
    mc, wc = _run(tiny_model_dir, compile_layers=True)
    for e, c in zip(m1, mc):
        assert c["loss"] == pytest.approx(e["loss"], rel=2e-2, abs=1e-6)
    # Two AdamW steps at lr 1e-2 move an adapter weight by at most ~2e-2 whatever the gradient.
    assert max((w1[k] - wc[k]).abs().max().item() for k in w1 if ".lora_" in k) < 5e-2
