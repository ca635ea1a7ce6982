"""The run spec's `eval` section at the REST edge of a real coordinator process (real HTTP, real Redis):
extra eval sets are read and checked at submit, confined to the data roots, and a bad one is a 422 naming
the field, with nothing stored."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.coordinator.spec_sections import MAX_EVAL_K, MAX_EVAL_SAMPLES

http = httpx.Client()


@pytest.fixture(autouse=True, scope="module")
def _authenticated(lone_coordinator):
    http.headers.update(lone_coordinator.headers)


def spec(model_dir: Path, eval_: dict, task: dict | None = None) -> dict:
    return {
        "name": "evalspec", "model_path": str(model_dir), "seed": 1, "steps": 2,
        "task": task or {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2, "sampling": {"max_new_tokens": 4}},
        "eval": {"every": 0, "heldout_size": 16, **eval_},
    }


def run_count(url: str) -> int:
    return len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"])


@pytest.fixture
def pairs(tmp_path):
    def make(lines: list[str], name: str = "extra.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join(line + "\n" for line in lines))
        return str(path)
    return make


def refused(url: str, body: dict) -> list[dict]:
    before = run_count(url)
    r = http.post(f"{url}/v1/runs", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert run_count(url) == before
    return r.json()["fields"]


GOOD = '{"a": 12, "b": 34}'


def test_a_bad_eval_set_is_422_naming_its_field(lone_coordinator, tiny_model_dir, pairs, tmp_path):
    url, good = lone_coordinator.url, pairs([GOOD])
    (tmp_path / "escape").symlink_to("/etc")
    cases = [
        # Outside the data roots, directly or through a symlink: refused before the file is even looked at.
        ([{"name": "x", "path": "/etc/hosts"}], "eval.sets.0.path", "outside the allowed roots"),
        ([{"name": "x", "path": str(tmp_path / "escape" / "hosts")}], "eval.sets.0.path", "outside the allowed roots"),
        ([{"name": "x", "path": str(tmp_path / "missing.jsonl")}], "eval.sets.0.path", "no such file"),
        ([{"name": "ok", "path": good}, {"name": "x", "path": pairs([GOOD, "{nope"], "bad.jsonl")}],
         "eval.sets.1.path", "line 2 of"),
        ([{"name": "x", "path": pairs(["", " "], "empty.jsonl")}], "eval.sets.0.path", "holds no problems"),
        ([{"name": "x", "path": good}, {"name": "x", "path": good}], "eval.sets.1.name", "'x' names an earlier set"),
        ([{"name": "heldout", "path": good}], "eval.sets.0.name", "task's own held-out split"),
        ([{"name": "a/b", "path": good}], "eval.sets.0.name", "should match pattern"),
        ([{"name": "x", "path": good, "size": 3}], "eval.sets.0.size", "Extra inputs"),
    ]
    for sets, field, reason in cases:
        fields = refused(url, spec(tiny_model_dir, {"sets": sets}))
        assert [f["field"] for f in fields] == [field], (sets, fields)
        assert reason in fields[0]["reason"], (sets, fields)


@pytest.mark.parametrize("eval_, field, reason", [
    ({"k": 4}, "eval.k", "greedy samples of one problem are all the same"),
    ({"k": MAX_EVAL_K + 1, "temperature": 1.0}, "eval.k", f"less than or equal to {MAX_EVAL_K}"),
    ({"k": 0}, "eval.k", "greater than or equal to 1"),
    ({"k": 64, "temperature": 1.0, "heldout_size": 100_000}, "eval.k", f"exceed {MAX_EVAL_SAMPLES} samples"),
    ({"temperature": 0.001}, "eval.temperature", "neither 0 (greedy) nor at least 0.01"),
    ({"temperature": 11.0}, "eval.temperature", "less than or equal to 10"),
    ({"max_new_tokens": 0}, "eval.max_new_tokens", "greater than or equal to 1"),
])
def test_bad_eval_sampling_is_422_naming_the_field(lone_coordinator, tiny_model_dir, eval_, field, reason):
    fields = refused(lone_coordinator.url, spec(tiny_model_dir, eval_))
    assert [f["field"] for f in fields] == [field], fields
    assert reason in fields[0]["reason"], fields


def test_math_eval_sets_are_read_with_the_math_reader(lone_coordinator, tiny_model_dir, tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"name": "math", "options": {"path": str(train), "answer_marker": "####", "heldout_size": 2}}
    # The set is read as the task reads its own file: the same answer_marker applies.
    unmarked = tmp_path / "unmarked.jsonl"
    unmarked.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    fields = refused(lone_coordinator.url, spec(tiny_model_dir, {"sets": [{"name": "m", "path": str(unmarked)}]},
                                                task))
    assert [f["field"] for f in fields] == ["eval.sets.0.path"], fields
    assert "does not contain answer_marker '####'" in fields[0]["reason"], fields

    r = http.post(f"{lone_coordinator.url}/v1/runs", timeout=60, json=spec(
        tiny_model_dir, {"k": 2, "temperature": 0.6, "max_new_tokens": 8, "sets": [{"name": "m", "path": str(train)}]},
        task))
    assert r.status_code == 201, r.text
    stored = http.get(f"{lone_coordinator.url}/v1/runs/{r.json()['id']}", timeout=30).json()["spec"]["eval"]
    assert stored["sets"] == [{"name": "m", "path": str(train.resolve())}] and stored["k"] == 2, stored
