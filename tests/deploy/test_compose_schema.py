"""deploy/docker-compose.yml and its NVIDIA override against the official Compose JSON schema.

The schema is vendored (deploy/compose-spec/, Apache-2.0) and checked with
jsonschema, so this runs everywhere, Docker or not. Compose validates a file
after interpolation, and applies `!reset` while merging; both are done here the
way test_compose.py reads the files (defaults of an empty environment).
"""
from __future__ import annotations

import copy
import json

import jsonschema
import pytest
import yaml

from tests.conftest import REPO_ROOT
from tests.deploy.test_compose import COMPOSE, NVIDIA, _Reset, interpolate, load, merge

SCHEMA_DIR = REPO_ROOT / "deploy" / "compose-spec"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMA_DIR / "compose-spec.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


class _ResetAsValue(yaml.SafeLoader):
    """An override file on its own: `!reset []` is the empty list Compose would leave."""


_ResetAsValue.add_constructor("!reset", lambda loader, node: loader.construct_sequence(node)
                              if isinstance(node, yaml.SequenceNode) else loader.construct_scalar(node))


def problems(validator: jsonschema.Draft7Validator, doc: dict) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc))


def test_vendored_schema_carries_its_licence():
    assert "Apache License" in (SCHEMA_DIR / "LICENSE").read_text()
    assert "Compose Specification" in (SCHEMA_DIR / "NOTICE").read_text()
    schema = json.loads((SCHEMA_DIR / "compose-spec.json").read_text())
    assert schema["title"] == "Compose Specification" and "services" in schema["properties"]


def test_compose_file_is_valid(validator):
    doc = interpolate(load(COMPOSE))
    assert problems(validator, doc) == []


def test_nvidia_override_is_valid_alone_and_merged(validator):
    override = interpolate(yaml.load(NVIDIA.read_text(), Loader=_ResetAsValue))  # noqa: S506 - SafeLoader subclass
    assert problems(validator, override) == []
    merged = interpolate(merge(load(COMPOSE), load(NVIDIA)))
    assert not any(isinstance(v, _Reset) for s in merged["services"].values() for v in s.values())
    assert problems(validator, merged) == []


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["services"]["trainer"]["healthcheck"].update(tset=["CMD", "true"]), "services.trainer.healthcheck"),
    (lambda d: d["services"]["rollout"].update(restart=["always"]), "services.rollout.restart"),
    (lambda d: d["services"]["coordinator"].update(depends_on={"redis": {"condition": "healthy"}}),
     "services.coordinator.depends_on"),
    (lambda d: d["services"]["redis"].update(imag="redis:7.2"), "services.redis"),
])
def test_schema_catches_what_compose_would_refuse(validator, mutate, where):
    doc = copy.deepcopy(interpolate(load(COMPOSE)))
    mutate(doc)
    found = problems(validator, doc)
    assert any(p.startswith(f"{where}:") for p in found), found
