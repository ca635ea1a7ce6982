"""rollout.weight_sync is checked at submit: a known source, shared_path only for whole-model runs,
broadcast to SGLang only for whole-model runs, ipc only to the torch engine, and under auto the same checks
on weight_sync_fallback."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec, validation_fields


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_model_dir(tmp_path_factory.mktemp("m") / "model", seed=0))


def _refused(**spec) -> list[dict[str, str]]:
    with pytest.raises(ValidationError) as exc:
        RunSpec.model_validate(spec)
    return validation_fields(exc.value.errors())


def test_the_default_is_the_grpc_stream_and_the_others_are_accepted(model):
    base = {"name": "s", "model_path": model, "steps": 1, "task": {"name": "arithmetic"}}
    assert RunSpec.model_validate(base).rollout.weight_sync == "grpc"
    assert RunSpec.model_validate({**base, "rollout": {"weight_sync": "shared_path"}}).rollout.weight_sync == "shared_path"
    for engine in ("torch", "sglang"):
        spec = RunSpec.model_validate({**base, "rollout": {"weight_sync": "broadcast", "engine": engine}})
        assert spec.rollout.weight_sync == "broadcast"
    # The torch engine receives a LoRA run's adapters over the broadcast as it does over the stream.
    lora = RunSpec.model_validate({**base, "rollout": {"weight_sync": "broadcast"},
                                   "trainer": {"lora": {"rank": 4, "alpha": 8.0}}})
    assert lora.rollout.weight_sync == "broadcast"


def test_an_unknown_source_is_refused_naming_the_field(model):
    fields = _refused(name="s", model_path=model, steps=1, task={"name": "arithmetic"},
                      rollout={"weight_sync": "nccl"})
    assert [f["field"] for f in fields] == ["rollout.weight_sync"]
    assert "'grpc', 'shared_path', 'broadcast', 'ipc' or 'auto'" in fields[0]["reason"]


def test_shared_path_is_refused_for_a_lora_run(model):
    fields = _refused(name="s", model_path=model, steps=1, task={"name": "arithmetic"},
                      rollout={"weight_sync": "shared_path"},
                      trainer={"lora": {"rank": 4, "alpha": 8.0}})
    assert fields == [{"field": "rollout.weight_sync",
                       "reason": "'shared_path' writes whole models; a run with trainer.lora syncs its adapters "
                                 "with 'grpc'"}]


def test_broadcast_to_sglang_is_refused_for_a_lora_run(model):
    fields = _refused(name="s", model_path=model, steps=1, task={"name": "arithmetic"},
                      rollout={"weight_sync": "broadcast", "engine": "sglang",
                               "engine_options": {"platform": "cuda", "server": {"max_lora_rank": 4}}},
                      trainer={"lora": {"rank": 4, "alpha": 8.0}})
    assert fields == [{"field": "rollout.weight_sync",
                       "reason": "'broadcast' to engine sglang carries whole models (SGLang loads LoRA adapters "
                                 "from files or tensors, not from a process group); a run with trainer.lora and "
                                 "engine sglang syncs its adapters with 'grpc'"}]


def test_ipc_goes_to_the_torch_engine_only_and_auto_checks_its_fallback(model):
    base = {"name": "s", "model_path": model, "steps": 1, "task": {"name": "arithmetic"}}
    for source in ("ipc", "auto"):
        spec = RunSpec.model_validate({**base, "rollout": {"weight_sync": source},
                                       "trainer": {"lora": {"rank": 4, "alpha": 8.0}}})
        assert spec.rollout.weight_sync == source and spec.rollout.non_ipc_source == "grpc"
    sglang = {"engine": "sglang", "engine_options": {"platform": "cuda"}}
    assert RunSpec.model_validate({**base, "rollout": {"weight_sync": "auto", **sglang}}).rollout.weight_sync == "auto"
    fields = _refused(**base, rollout={"weight_sync": "ipc", **sglang})
    assert [f["field"] for f in fields] == ["rollout.weight_sync"] and "another" in fields[0]["reason"]
    fields = _refused(**base, rollout={"weight_sync": "auto", "weight_sync_fallback": "shared_path"},
                      trainer={"lora": {"rank": 4, "alpha": 8.0}})
    assert [f["field"] for f in fields] == ["rollout.weight_sync_fallback"]
    assert RunSpec.model_validate({**base, "rollout": {"weight_sync": "ipc", "weight_sync_fallback": "shared_path"},
                                   "trainer": {"lora": {"rank": 4, "alpha": 8.0}}}).rollout.non_ipc_source \
        == "shared_path"  # never used: an explicit ipc run that cannot use it fails
