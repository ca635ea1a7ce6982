"""LoRA adapters on the rollout side: the embedded engine's merge against peft's, the stream's metadata,
and what is refused (nothing applied)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.weights.stream import LoraAdapterMeta, WeightStreamAssembler, WeightStreamError, iter_weight_chunks
from services.rollout.embedded.torch_engine import TorchEngine, TorchEngineConfig
from services.rollout.weights.lora_adapter import write_peft_adapter

TARGETS = ["q_proj", "v_proj", "down_proj"]
META = LoraAdapterMeta(rank=4, alpha=16.0, target_modules=tuple(sorted(TARGETS)))


def build_tiny_qwen3(path: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


def random_adapter(model_dir: Path, out: Path, *, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    """A peft adapter with random A and B (B is zero at peft's init, which would test nothing), saved by peft."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=META.rank, lora_alpha=META.alpha, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(out))
    return out, load_file(str(out / "adapter_model.safetensors"))


def peft_merged(model_dir: Path, adapter_dir: Path) -> dict[str, torch.Tensor]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().state_dict()


def engine(model_dir: Path, dtype: str = "float32") -> TorchEngine:
    e = TorchEngine(TorchEngineConfig(dtype=dtype))
    e.load(str(model_dir), 0)
    return e


def weights(e: TorchEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in e._require_model().state_dict().items()}


def test_merge_matches_peft_and_each_version_starts_from_the_base(model_dir, tmp_path):
    first_dir, first = random_adapter(model_dir, tmp_path / "a1", seed=1)
    second_dir, second = random_adapter(model_dir, tmp_path / "a2", seed=2)
    e = engine(model_dir)
    base = weights(e)
    e.update_lora_adapter(META, first, 1)
    merged = weights(e)
    expected = peft_merged(model_dir, first_dir)
    assert set(merged) == set(expected)
    for k, v in expected.items():
        assert torch.allclose(merged[k], v, rtol=0, atol=1e-6), k
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in (0, 1)
                       for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")}
    assert e.policy_version == 1

    # Version 2 is merged into the pristine base, not onto version 1: bitwise what a fresh engine gets.
    e.update_lora_adapter(META, second, 2)
    fresh = engine(model_dir)
    fresh.update_lora_adapter(META, second, 2)
    assert all(torch.equal(v, weights(fresh)[k]) for k, v in weights(e).items())
    for k, v in peft_merged(model_dir, second_dir).items():
        assert torch.allclose(weights(e)[k], v, rtol=0, atol=1e-6), k

    # The loaded version again: the same adapter is a no-op, another one refused.
    e.update_lora_adapter(META, second, 2)
    with pytest.raises(ValueError, match="policy_version: 2 is already loaded with different weights"):
        e.update_lora_adapter(META, first, 2)

    # A full set of weights afterwards is a new base.
    e.update_weights(base, 3)
    assert all(torch.equal(v, base[k]) for k, v in weights(e).items())


def test_bf16_engine_merges_in_float32_then_casts(model_dir, tmp_path):
    _, adapter = random_adapter(model_dir, tmp_path / "a", seed=3)
    e = engine(model_dir, "bfloat16")
    base = weights(e)
    e.update_lora_adapter(META, adapter, 1)
    name = "model.layers.1.mlp.down_proj.weight"
    a = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    b = adapter["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    expected = (base[name].float() + META.scale * (b.float() @ a.float())).to(torch.bfloat16)
    assert weights(e)[name].dtype == torch.bfloat16 and torch.equal(weights(e)[name], expected)


def _key(module: str, part: str) -> str:
    return f"base_model.model.{module}.{part}.weight"


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda t: t.pop(_key("model.layers.0.self_attn.q_proj", "lora_B")), "lora_B.weight: missing"),
    (lambda t: t.update({_key("model.layers.0.self_attn.q_proj", "lora_A"): torch.zeros(3, 32)}),
     "does not have rank 4"),
    (lambda t: t.update({_key("model.layers.0.self_attn.q_proj", "lora_A"): torch.full((4, 32), float("nan"))}),
     "not finite"),
    (lambda t: t.update({_key("model.layers.9.self_attn.q_proj", "lora_A"): torch.zeros(4, 32),
                         _key("model.layers.9.self_attn.q_proj", "lora_B"): torch.zeros(32, 4)}),
     "model.layers.9.self_attn.q_proj: not a linear layer of the loaded model"),
    (lambda t: t.update({_key("model.layers.0.mlp.up_proj", "lora_A"): torch.zeros(4, 32),
                         _key("model.layers.0.mlp.up_proj", "lora_B"): torch.zeros(64, 4)}),
     "not among lora.target_modules"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)}),
     "not a LoRA adapter tensor"),
])
def test_a_bad_adapter_is_refused_and_nothing_applied(model_dir, tmp_path, edit, reason):
    _, adapter = random_adapter(model_dir, tmp_path / "a", seed=4)
    e = engine(model_dir)
    before = weights(e)
    edit(adapter)
    with pytest.raises(ValueError, match=reason):
        e.update_lora_adapter(META, adapter, 1)
    assert e.policy_version == 0 and all(torch.equal(v, weights(e)[k]) for k, v in before.items())


def test_written_adapter_dir_loads_in_peft(model_dir, tmp_path):
    from peft import PeftConfig

    _, adapter = random_adapter(model_dir, tmp_path / "a", seed=5)
    out = write_peft_adapter(tmp_path / "written", adapter, META, base_model_path=str(model_dir))
    config = PeftConfig.from_pretrained(str(out))
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 16.0, sorted(TARGETS))
    e = engine(model_dir)
    e.update_lora_adapter(META, adapter, 1)
    for k, v in peft_merged(model_dir, out).items():
        assert torch.allclose(weights(e)[k], v, rtol=0, atol=1e-6), k


def test_stream_carries_the_adapter_metadata_and_refuses_it_changing():
    tensors = [(_key("model.layers.0.self_attn.q_proj", "lora_A"), torch.ones(4, 32)),
               (_key("model.layers.0.self_attn.q_proj", "lora_B"), torch.ones(32, 4))]
    chunks = list(iter_weight_chunks(tensors, run_id="r", policy_version=3, chunk_bytes=256, lora=META))
    assert len(chunks) > 2 and all(c.HasField("lora") for c in chunks)
    a = WeightStreamAssembler()
    for c in chunks:
        a.add(c)
    assert a.lora == META and set(a.finish()) == {n for n, _ in tensors}

    plain = list(iter_weight_chunks(tensors, run_id="r", policy_version=3, chunk_bytes=256))
    b = WeightStreamAssembler()
    for c in plain:
        b.add(c)
    assert b.lora is None and not plain[0].HasField("lora")

    mixed = [chunks[0], *plain[1:]]
    with pytest.raises(WeightStreamError, match="lora adapter metadata changed mid-stream"):
        c = WeightStreamAssembler()
        for chunk in mixed:
            c.add(chunk)
    bad = list(iter_weight_chunks(tensors, run_id="r", policy_version=3,
                                  lora=LoraAdapterMeta(rank=0, alpha=1.0, target_modules=("q_proj",))))
    with pytest.raises(WeightStreamError, match="lora.rank: must be >= 1"):
        WeightStreamAssembler().add(bad[0])
