"""The example run specs in deploy/examples stay valid as the configs evolve.

Each is validated the way the coordinator validates a submission (parse_run_spec, strict),
with its engine options validated by the engine's own config, and its paths
checked against the compose volumes they must live on.
"""
from __future__ import annotations

import json

import pytest
import yaml

from contract.engine_options import SGLangEngineConfig, TorchEngineConfig
from services.coordinator.run_spec import parse_run_spec
from tests.conftest import REPO_ROOT

EXAMPLES = sorted((REPO_ROOT / "deploy" / "examples").glob("*.yaml"))
# The engines' own option models, as LoadModel validates them.
ENGINE_CONFIGS = {"torch": TorchEngineConfig, "sglang": SGLangEngineConfig}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_spec_is_valid(path, tmp_path):
    raw = yaml.safe_load(path.read_text())
    # Models live on the compose volumes: read-only /models, or /runs for what is built in the stack.
    assert raw["model_path"].startswith(("/models/", "/runs/")), raw["model_path"]
    model = tmp_path / "model"  # RunSpec only checks for a Hugging Face directory here
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec = parse_run_spec(json.dumps({**raw, "model_path": str(model)}).encode())  # as POST /v1/runs: strict
    cfg = ENGINE_CONFIGS[spec.rollout.engine].from_json(json.dumps(spec.rollout.engine_options))
    # The invariant: both sides compute in the same dtype.
    engine_dtype = cfg.server.dtype if spec.rollout.engine == "sglang" else cfg.dtype
    assert engine_dtype == spec.trainer.dtype, f"{path.name}: rollout {engine_dtype} vs trainer {spec.trainer.dtype}"


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"tiny-gpu-smoke.yaml", "qwen3-sglang-mi300.yaml"}
