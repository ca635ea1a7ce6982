"""Schemathesis over the OpenAPI document of a real coordinator process.

Every operation, then stateful sequences (submit -> get / metrics / cancel /
resume through the document's links), with two checks: no response is a server
error, and every status code is one the document declares. The run is kept
short for CI by bounded example counts.
"""
from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

CHECKS = [not_a_server_error, status_code_conformance]
# Sent with every request: the coordinator's bearer token (filled in by the fixture below).
HEADERS: dict[str, str] = {}
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate])


def document(url: str) -> dict:
    return httpx.get(f"{url}/openapi.json", headers=HEADERS, timeout=30).json()


def load(raw: dict, url: str):
    schema = schemathesis.openapi.from_dict(raw)
    schema.config.update(base_url=url)
    return schema


@pytest.fixture(autouse=True, scope="module")
def _authenticated(lone_coordinator):
    HEADERS.update(lone_coordinator.headers)


@pytest.fixture(scope="module")
def api_schema(lone_coordinator):
    return load(document(lone_coordinator.url), lone_coordinator.url)


@pytest.fixture(scope="module")
def submittable_schema(lone_coordinator, tiny_model_dir):
    """The same document, with the run spec narrowed to specs this coordinator accepts (its model directory,
    the arithmetic task): the stateful phase needs submissions that succeed, so that its sequences reach real
    runs through the links of POST's 201. Every other operation is as served."""
    raw = copy.deepcopy(document(lone_coordinator.url))
    schemas = raw["components"]["schemas"]
    full = schemas["RunSpec"]["properties"]
    schemas["RunSpec"] = {
        "type": "object", "required": ["name", "model_path", "steps", "task"], "additionalProperties": False,
        "properties": {
            "name": full["name"], "seed": full["seed"], "steps": full["steps"],
            "model_path": {"type": "string", "enum": [str(tiny_model_dir)]},
            "task": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "enum": ["arithmetic"]}}},
        },
    }
    return load(raw, lone_coordinator.url)


OPERATIONS = ["POST /v1/runs", "GET /v1/runs", "GET /v1/runs/{run_id}", "GET /v1/runs/{run_id}/metrics",
              "POST /v1/runs/{run_id}/cancel", "POST /v1/runs/{run_id}/resume", "GET /healthz", "GET /readyz",
              "GET /metrics", "GET /v1/runs/{run_id}/bundle", "GET /v1/runs/{run_id}/step_records/{step}",
              "POST /v1/runs/import", "GET /v1/compare", "GET /v1/runs/{run_id}/steps/{step}/episodes",
              "GET /v1/runs/{run_id}/steps/{step}/samples"]


def test_the_document_has_exactly_the_operations_tested(api_schema):
    assert sorted(op.ok().label for op in api_schema.get_all_operations()) == sorted(OPERATIONS)


# Negative cases (inputs that violate the document) exist only for operations that take input.
WITH_INPUT = [op for op in OPERATIONS if op.startswith("POST /v1/runs") or "{run_id}" in op or op == "GET /v1/compare"]


@pytest.mark.parametrize("label, mode", [(op, GenerationMode.POSITIVE) for op in OPERATIONS]
                         + [(op, GenerationMode.NEGATIVE) for op in WITH_INPUT],
                         ids=lambda v: v.value if isinstance(v, GenerationMode) else v)
def test_every_operation_answers_only_documented_codes_and_no_5xx(api_schema, label, mode):
    [operation] = [op.ok() for op in api_schema.get_all_operations() if op.ok().label == label]

    # /readyz answers 503 by design while a service is down (here: always); it is declared, and still
    # held to the declared codes.
    checks = [status_code_conformance] if label == "GET /readyz" else CHECKS

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=20, **SETTINGS)
    def check(case):
        case.call_and_validate(headers=HEADERS, checks=checks, timeout=60)

    check()


def test_stateful_sequences_answer_only_documented_codes_and_no_5xx(submittable_schema, lone_coordinator):
    before = len(httpx.get(f"{lone_coordinator.url}/v1/runs", headers=HEADERS, timeout=30).json()["runs"])
    base = submittable_schema.as_state_machine()

    class Workflow(base):  # type: ignore[misc, valid-type]
        def get_call_kwargs(self, case):
            return {"headers": HEADERS, "timeout": 60}

        def validate_response(self, response, case, additional_checks=None, **kwargs):
            checks = [status_code_conformance] if case.operation.label == "GET /readyz" else CHECKS
            case.validate_response(response, checks=checks, transport_kwargs=kwargs or None)

    Workflow.run(settings=settings(max_examples=15, stateful_step_count=6, **SETTINGS))
    assert len(httpx.get(f"{lone_coordinator.url}/v1/runs", headers=HEADERS, timeout=30).json()["runs"]) > before, \
        "no sequence created a run: the links were never followed"


def test_the_document_declares_every_code_the_hostile_cases_get(lone_coordinator):
    doc = httpx.get(f"{lone_coordinator.url}/openapi.json", timeout=30).json()
    codes = {path: {method: set(op["responses"]) for method, op in ops.items()} for path, ops in doc["paths"].items()}
    assert codes["/v1/runs"]["post"] >= {"201", "413", "422"}
    for path in ("/v1/runs/{run_id}", "/v1/runs/{run_id}/metrics"):
        assert "404" in codes[path]["get"]
    assert codes["/v1/runs/{run_id}/cancel"]["post"] >= {"200", "404", "409"}
    assert codes["/v1/runs/{run_id}/resume"]["post"] >= {"200", "404", "409"}
    assert codes["/readyz"]["get"] >= {"200", "503"}
    body = doc["paths"]["/v1/runs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/RunSpec"} and "RunSpec" in doc["components"]["schemas"]

