"""Hostile input at the REST edge of a real coordinator process (real HTTP, real Redis).

Each case was a 500 or an accepted spec that failed only at run time: every
one must be a 422 naming the field, with nothing stored.
"""
from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

# Every /v1 call carries the coordinator's bearer token (set by the fixture below).
http = httpx.Client()


@pytest.fixture(autouse=True, scope="module")
def _authenticated(lone_coordinator):
    http.headers.update(lone_coordinator.headers)


def spec(model_dir: Path, **over) -> dict:
    base = {
        "name": "hostile", "model_path": str(model_dir), "seed": 1, "steps": 2,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "trainer": {"lr": 1e-3, "temperature": 1.0},
        "eval": {"every": 0, "heldout_size": 16},
    }
    for dotted, value in over.items():
        node = base
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return base


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def run_count(url: str) -> int:
    return len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"])


@pytest.fixture
def math_file(tmp_path):
    def make(n: int, name: str = "train.jsonl") -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"}) + "\n"
                                for i in range(n)))
        return path
    return make


def math_task(path: Path, **options) -> dict:
    return {"name": "math", "options": {"path": str(path), "answer_marker": "####", "heldout_size": 2, **options}}


CASES = [
    ({"steps": True}, "steps"),
    ({"seed": "3"}, "seed"),
    ({"task.options.digits": 5.5}, "task.options"),
    ({"task.options.reverse_answer": 1}, "task.options"),
    ({"task.options.train_size": 10**6}, "task.options"),
    ({"rollout.sampling.temperature": 1e-320, "trainer.temperature": 1e-320}, "rollout.sampling.temperature"),
    ({"rollout.sampling.top_p": 1e-45}, "rollout.sampling.top_p"),
    ({"trainer.lr": 1e308}, "trainer.lr"),
    ({"trainer.lr": True}, "trainer.lr"),
    ({"model_path": "/" + "m" * 300}, "model_path"),
    ({"rollout.engine_options": {"no_such_option": 1}}, "rollout.engine_options"),
    ({"rollout.engine_options": {"dtype": "float64"}}, "rollout.engine_options"),
    ({"rollout.engine_options": {"engine": "sglang"}}, "rollout.engine_options"),
    ({"rollout.engine_options": nested(220)}, "rollout.engine_options"),
    ({"rollout.engine_options": nested(600)}, "rollout.engine_options"),
    ({"rollout.engine_options": nested(20)}, "rollout.engine_options"),
    ({"task.options": nested(20)}, "task.options"),
]


@pytest.mark.parametrize("override, field", CASES, ids=[next(iter(o)) + f"-{i}" for i, (o, _) in enumerate(CASES)])
def test_hostile_spec_is_422_naming_the_field_and_stores_nothing(lone_coordinator, tiny_model_dir, override, field):
    url = lone_coordinator.url
    before = run_count(url)
    r = http.post(f"{url}/v1/runs", json=spec(tiny_model_dir, **override), timeout=60)
    assert r.status_code == 422, r.text
    fields = r.json()["fields"]
    assert any(f["field"] == field or f["field"].startswith(field + ".") for f in fields), fields
    assert all(f["reason"] for f in fields)
    assert run_count(url) == before
    assert http.get(f"{url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("template, message", [
    ("{question:>100000000000}", "format spec"),
    ("{question!r}", "format spec or conversion"),
    ("{question.__class__}", "no other"),
    ("{question[0]}", "no other"),
    (["{question}"], "valid string"),
    (7, "valid string"),
])
def test_math_prompt_template_allows_only_a_plain_placeholder(lone_coordinator, tiny_model_dir, math_file,
                                                            template, message):
    url = lone_coordinator.url
    before = run_count(url)
    body = spec(tiny_model_dir, task=math_task(math_file(8), prompt_template=template))
    r = http.post(f"{url}/v1/runs", json=body, timeout=60)
    assert r.status_code == 422, r.text
    [err] = r.json()["fields"]
    assert err["field"] == "task.options" and "prompt_template" in err["reason"] and message in err["reason"], err
    assert run_count(url) == before


def test_unreadable_or_oversized_bodies_are_refused(lone_coordinator):
    url = lone_coordinator.url
    before = run_count(url)
    for body, status in ((b"[" * 100_000 + b"]" * 100_000, 422), (b"{not json", 422), (b"[1, 2]", 422),
                         (b" " * (2 * 1024 * 1024), 413)):
        r = http.post(f"{url}/v1/runs", content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == status, (body[:20], r.text[:300])
        assert r.json()["fields"][0]["reason"]
    assert run_count(url) == before


def test_an_unknown_engine_option_is_named(lone_coordinator, tiny_model_dir):
    r = http.post(f"{lone_coordinator.url}/v1/runs",
                   json=spec(tiny_model_dir, **{"rollout.engine_options": {"dtype": "float32", "no_such_option": 1}}),
                   timeout=60)
    assert r.status_code == 422
    [err] = r.json()["fields"]
    assert err["field"] == "rollout.engine_options" and "engine_config.no_such_option" in err["reason"], err


def test_a_valid_spec_is_stored_and_answers_get(lone_coordinator, tiny_model_dir):
    url = lone_coordinator.url
    r = http.post(f"{url}/v1/runs", json=spec(tiny_model_dir, **{"rollout.engine_options": {"dtype": "float32"}}),
                   timeout=60)
    assert r.status_code == 201, r.text
    got = http.get(f"{url}/v1/runs/{r.json()['id']}", timeout=30)
    assert got.status_code == 200 and got.json()["spec"]["rollout"]["engine_options"] == {"dtype": "float32"}


@pytest.mark.parametrize("suffix", [":events", ":metrics", ":timings", ":spec", ":aux", "*", ""])
def test_run_ids_other_than_the_minted_pattern_are_404(lone_coordinator, tiny_model_dir, suffix):
    url = lone_coordinator.url
    run_id = http.post(f"{url}/v1/runs", json=spec(tiny_model_dir), timeout=60).json()["id"]
    bad = (run_id + suffix) if suffix else run_id.upper()
    for method, path in (("GET", f"/v1/runs/{bad}"), ("GET", f"/v1/runs/{bad}/metrics"),
                         ("POST", f"/v1/runs/{bad}/cancel"), ("POST", f"/v1/runs/{bad}/resume")):
        r = http.request(method, f"{url}{path}", timeout=30)
        assert r.status_code == 404, (method, path, r.status_code, r.text[:300])
    assert http.get(f"{url}/v1/runs/{run_id}", timeout=30).status_code == 200


def test_large_dataset_submit_keeps_healthz_answering(lone_coordinator, tiny_model_dir, math_file):
    """Parsing 7.5k reference answers takes seconds of CPU: it must not be on the event loop."""
    url = lone_coordinator.url
    body = spec(tiny_model_dir, task=math_task(math_file(7500)))
    result: dict = {}

    def submit() -> None:
        result["response"] = http.post(f"{url}/v1/runs", json=body, timeout=600)

    submitter = threading.Thread(target=submit)
    latencies = []
    # This process holds torch and the model too: its own garbage collector could stall a probe here, which
    # is not the coordinator's latency.
    gc.disable()
    try:
        with httpx.Client(timeout=30) as client:
            client.get(f"{url}/healthz")  # connection made before the clock starts
            submitter.start()
            while submitter.is_alive():
                t0 = time.perf_counter()
                assert client.get(f"{url}/healthz").status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.05)
        submitter.join()
    finally:
        gc.enable()
    assert result["response"].status_code == 201, result["response"].text
    assert len(latencies) >= 10, "the submit was too quick to measure anything"
    # On a loaded 2-core machine (other test runs beside this one) a probe can wait for a core held by
    # another process: 95% within 100 ms and none near a second. A blocked event loop instead holds the
    # probes for the whole validation (seconds), and only a handful get made.
    slow = sorted(t for t in latencies if t >= 0.1)
    assert len(slow) <= len(latencies) // 20, (len(latencies), slow)
    assert max(latencies) < 1.0, (len(latencies), slow)


def test_dataset_over_the_line_limit_is_422(lone_coordinator, tiny_model_dir, math_file, monkeypatch):
    from services.coordinator.tasks.math_dataset import MAX_DATASET_LINES

    url = lone_coordinator.url
    path = math_file(0)
    path.write_text("\n" * (MAX_DATASET_LINES + 1))
    r = http.post(f"{url}/v1/runs", json=spec(tiny_model_dir, task=math_task(path)), timeout=120)
    assert r.status_code == 422 and f"more than {MAX_DATASET_LINES} lines" in r.json()["fields"][0]["reason"], r.text
