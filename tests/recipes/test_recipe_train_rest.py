"""`lockstep recipe prepare` then `full-train` against a real coordinator (real HTTP, embedded redis-server).

The recipe's inputs are tiny stand-ins placed where prepare says; the run is
accepted and the spec the coordinator stored is the one the launcher
resolved. The coordinator has no trainer or rollout behind it (see
tests/coordinator/conftest.py), so the run fails right after it is accepted:
acceptance and the stored spec are what is checked here, not training.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.cli.__main__ import _parser
from services.cli.recipe_commands import RECIPES_ROOT, RecipeRequest
from services.cli.recipe_layout import find_recipe
from services.common.auth import TOKEN_FILE_ENV
from services.coordinator.run_spec import parse_run_spec
from tests.coordinator.conftest import LoneCoordinator
from tests.recipes.recipe_inputs import build_tiny_model, place_tiny_inputs

pytestmark = pytest.mark.slow
RECIPES = ("qwen3_8b_m2po", "qwen3_4b_lora_grpo", "qwen3_8b_to_1_7b_distill", "qwen3_4b_sft")


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    c = LoneCoordinator(tmp_path_factory.mktemp("coordinator"), tmp_path_factory.getbasetemp()).start()
    try:
        yield c
    finally:
        c.process.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def lockstep(coordinator: LoneCoordinator, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "--url", coordinator.url,
                           "--token-file", coordinator.process.env[TOKEN_FILE_ENV], *args],
                          capture_output=True, text=True, timeout=300)


def assert_carries(stored: object, sent: object, where: str = "spec") -> None:
    """Every field the launcher set is stored with the same value (the coordinator adds the defaults)."""
    if isinstance(sent, dict):
        assert isinstance(stored, dict), f"{where}: stored {stored!r}"
        for key, value in sent.items():
            assert key in stored, f"{where}.{key}: not stored"
            assert_carries(stored[key], value, f"{where}.{key}")
    elif isinstance(sent, list):
        assert isinstance(stored, list) and len(stored) == len(sent), f"{where}: stored {stored!r}"
        for i, (a, b) in enumerate(zip(stored, sent)):
            assert_carries(a, b, f"{where}.{i}")
    else:
        assert stored == sent and type(stored) is type(sent), f"{where}: stored {stored!r}, sent {sent!r}"


@pytest.mark.parametrize("name", RECIPES)
def test_full_train_submits_the_resolved_spec_to_a_real_coordinator(name, coordinator, tmp_path, tiny_model):
    dirs = ["--models-dir", str(tmp_path / "models"), "--data-dir", str(tmp_path / "data")]
    resolved = RecipeRequest.from_args(_parser().parse_args(["recipe", "train", name, *dirs])).spec()
    first = lockstep(coordinator, "recipe", "full-train", name, *dirs)
    assert first.returncode == 1 and "not submitting until prepare's checks pass" in first.stdout, first.stdout
    runs = httpx.get(f"{coordinator.url}/v1/runs", headers=coordinator.headers).json()["runs"]
    assert resolved["name"] not in [r["name"] for r in runs]  # nothing submitted while inputs are missing

    place_tiny_inputs(find_recipe(name, RECIPES_ROOT), tmp_path / "models", tmp_path / "data", tiny_model)
    out = lockstep(coordinator, "recipe", "full-train", name, *dirs)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "result: ready" in out.stdout
    run_id = next(line.split()[2] for line in out.stdout.splitlines() if line.startswith("submitted run"))

    run = httpx.get(f"{coordinator.url}/v1/runs/{run_id}", headers=coordinator.headers).json()
    assert run["name"] == resolved["name"]
    assert_carries(run["spec"], resolved)
    # and nothing else: the rest is the defaults the coordinator's own validation fills in
    assert run["spec"] == json.loads(parse_run_spec(json.dumps(resolved).encode()).model_dump_json())

    # The same spec straight over HTTP: 201, as the CLI's submit got.
    direct = httpx.post(f"{coordinator.url}/v1/runs", headers=coordinator.headers, content=json.dumps(resolved),
                        timeout=120)
    assert direct.status_code == 201, direct.text
