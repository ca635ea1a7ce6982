"""LoRA on the trainer: only adapters train, are checkpointed (peft layout) and are streamed; config refusals."""
from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError
from trainer_support import make_episodes, rollout_logprobs

from contract.trainer_run import TrainerRunConfig
from services.common.models.loading import load_causal_lm
from services.trainer.data.batching import TrainSample
from services.trainer.data.wire import InvalidRequest, StepRequest
from services.trainer.loss.surrogate import group_advantages
from services.trainer.trainer import Trainer
from tests.support.rounding_bounds import response_logprob_bounds

pytestmark = pytest.mark.usefixtures("restore_torch_globals")

LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
RUN_CONFIG = {"lr": 1e-2, "microbatch_tokens": 24, "grad_clip": 1.0, "lora": LORA}


def configure(model_dir, *, run_id="run", resume="", **overrides) -> Trainer:
    t = Trainer(num_threads=1)
    t.configure(run_id=run_id, model_path=str(model_dir), seed=11, config_json=json.dumps(RUN_CONFIG | overrides),
                resume_checkpoint=resume)
    return t


def on_policy_step(trainer: Trainer, step: int, *, seed: int = 1) -> StepRequest:
    eps = make_episodes(seed=seed + step)
    adv = group_advantages([e["reward"] for e in eps], [e["group_id"] for e in eps])
    model = trainer.run.model
    samples = [TrainSample(e["sample_id"], e["group_id"], torch.tensor(e["prompt"]), torch.tensor(e["response"]),
                           torch.tensor(rollout_logprobs(model, e["prompt"], e["response"])), e["reward"], a)
               for e, a in zip(eps, adv)]
    return StepRequest(trainer.run.run_id, step, step - 1, samples)


def base_weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_only_adapters_train_and_step1_is_on_policy(tiny_model_dir):
    t = configure(tiny_model_dir)
    lm = t.run.policy.lm
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    # Every linear layer of both decoder layers gets an adapter; the output head does not.
    assert len(trainable) == 2 * 7 * 2
    in_optimizer = {id(p) for g in t.run.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in lm.named_parameters() if n in trainable}

    req = on_policy_step(t, 1)
    m = t.train_step(req).metrics
    # lora_B starts at zero, so step 1 computes the base model's function exactly (x A 0 = 0, y + 0 = y):
    # the trainer and rollout differ by the base model's float32 rounding only.
    bound = response_logprob_bounds(load_causal_lm(tiny_model_dir),
                                    [(s.prompt_ids.tolist(), s.response_ids.tolist()) for s in req.samples])
    assert abs(m["iw_mean"] - 1) <= bound.expm1().mean().item() and m["logprob_abs_diff_max"] <= bound.max().item()
    assert m["grad_norm"] > 0
    t.train_step(on_policy_step(t, 2))
    masters = t.master_state_dict()
    for name, value in base_weights(tiny_model_dir).items():
        # The frozen base sits under peft's base_layer for adapted modules, under its own name otherwise.
        key = name.replace(".weight", ".base_layer.weight") if name.replace(".weight", ".base_layer.weight") in masters else name
        assert torch.equal(masters[key], value), name
    assert any(v.abs().sum() > 0 for k, v in masters.items() if ".lora_B." in k)  # B left zero: adapters moved


def test_weight_sync_streams_the_adapters_alone(tiny_model_dir):
    t = configure(tiny_model_dir)
    t.train_step(on_policy_step(t, 1))
    snap = t.weight_tensors("run")
    assert snap.lora is not None and (snap.lora.rank, snap.lora.alpha) == (4, 8.0)
    assert snap.lora.target_modules == ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    names = [n for n, _ in snap.tensors]
    assert len(names) == 28 and all(n.startswith("base_model.model.model.layers.") for n in names)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    sent = sum(v.numel() * v.element_size() for _, v in snap.tensors)
    full = sum(v.numel() * v.element_size() for v in base_weights(tiny_model_dir).values())
    assert sent < full / 2


def test_adapter_checkpoint_is_peft_loadable_and_resumes_exactly(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = configure(tiny_model_dir)
    for s in (1, 2):
        t.train_step(on_policy_step(t, s))
    ckpt_dir, version = t.save_checkpoint("run", str(tmp_path / "step_2"))
    names = {p.name for p in ckpt_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt", "lockstep_trainer_state.json",
            "tokenizer.json"} <= names
    assert "model.safetensors" not in names  # the base is the run's model, never copied
    config = json.loads((ckpt_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]

    # peft loads it onto the base and computes what the trainer computes.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, str(ckpt_dir)).eval()
    ids = torch.tensor([[3, 9, 14, 5, 27, 8]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, t.run.model(input_ids=ids).logits, atol=1e-6)

    # A fresh trainer resumed from it: same version, and the next step is bitwise the uninterrupted one.
    r = configure(tiny_model_dir, resume=str(ckpt_dir))
    assert r.run.policy_version == version == 2
    step3 = on_policy_step(t, 3)
    assert r.train_step(step3).metrics == t.train_step(step3).metrics
    assert all(torch.equal(v, r.master_state_dict()[k]) for k, v in t.master_state_dict().items())

    # LoadCheckpoint into the held run rolls the adapters and their optimizer state back.
    at3 = t.master_state_dict()
    assert t.load_checkpoint("run", str(ckpt_dir)) == 2
    assert t.train_step(step3).metrics == r.run.step_metrics[3]
    assert all(torch.equal(v, t.master_state_dict()[k]) for k, v in at3.items())

    # A LoRA run refuses a full-model checkpoint (and the other way round), naming the field.
    full = Trainer(num_threads=1)
    full.configure(run_id="full", model_path=str(tiny_model_dir), seed=11,
                   config_json=json.dumps({k: v for k, v in RUN_CONFIG.items() if k != "lora"}))
    full_ckpt, _ = full.save_checkpoint("full", str(tmp_path / "full"))
    with pytest.raises(InvalidRequest, match="resume_checkpoint: .*no adapter_model.safetensors"):
        configure(tiny_model_dir, run_id="full", resume=str(full_ckpt))
    with pytest.raises(InvalidRequest, match="resume_checkpoint: .* has no config.json"):
        Trainer(num_threads=1).configure(run_id="run", model_path=str(tiny_model_dir), seed=11,
                                         config_json=json.dumps({k: v for k, v in RUN_CONFIG.items() if k != "lora"}),
                                         resume_checkpoint=str(ckpt_dir))
    with pytest.raises(InvalidRequest, match="directory: .*no adapter_model.safetensors"):
        configure(tiny_model_dir, run_id="full").load_checkpoint("full", str(full_ckpt))


@pytest.mark.parametrize(("lora", "field", "reason"), [
    ({**LORA, "dropout": 0.05}, "lora.dropout", "only 0 is supported"),
    ({**LORA, "rank": 0}, "lora.rank", "greater than or equal to 1"),
    ({**LORA, "alpha": 0.0}, "lora.alpha", "greater than 0"),
    ({**LORA, "target_modules": []}, "lora.target_modules", "non-empty list"),
    ({**LORA, "target_modules": ["q_proj", "q_proj"]}, "lora.target_modules", "distinct"),
    ({**LORA, "target_modules": ["../x"]}, "lora.target_modules", "not a module name"),
    ({**LORA, "target_modules": "all"}, "lora.target_modules", "all-linear"),
    ({"rank": 4}, "lora.alpha", "Field required"),
])
def test_bad_lora_settings_are_refused_naming_the_field(lora, field, reason):
    with pytest.raises(ValidationError) as info:
        TrainerRunConfig.model_validate({"lora": lora})
    errors = [(".".join(str(p) for p in e["loc"]), e["msg"]) for e in info.value.errors()]
    assert any(loc.startswith(field) and reason in msg for loc, msg in errors), errors


def test_settings_the_model_cannot_take_are_refused_at_configure(tiny_model_dir):
    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.lora\.target_modules: .*not_a_layer"):
        configure(tiny_model_dir, lora={**LORA, "target_modules": ["not_a_layer"]})
    with pytest.raises(InvalidRequest, match=r"trainer_config_json\.lora\.base_on_cpu: .*needs an accelerator"):
        configure(tiny_model_dir, lora={**LORA, "base_on_cpu": True})
