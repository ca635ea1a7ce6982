"""The run spec's `teacher` (on-policy distillation): checked at submit, refused naming teacher.model_path.

Through a real coordinator's REST edge: a teacher whose tokenizer differs from the student's is a 422 naming
`teacher.model_path` and the first differing token, and nothing is stored; so is one outside the operator's
model roots or missing. A valid teacher reaches the trainer's configuration.
"""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from recipes.char_tokenizer import CharVocab
from recipes.tiny_model import TinyQwen3Config, build_model_dir, build_tiny_qwen3, save_model_dir
from services.coordinator.run_spec import RunSpec, RunSpecError, parse_run_spec

http = httpx.Client()
BIGGER = TinyQwen3Config(hidden_size=96, num_hidden_layers=3)


@pytest.fixture(autouse=True, scope="module")
def _authenticated(lone_coordinator):
    http.headers.update(lone_coordinator.headers)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("teacher") / "t", BIGGER, seed=1)


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory) -> Path:
    vocab = CharVocab(characters=tuple("0123456789+="))
    return save_model_dir(build_tiny_qwen3(seed=2, vocab=vocab), tmp_path_factory.mktemp("other") / "o", vocab)


def spec(model_dir: Path, teacher: dict | None, trainer: dict | None = None) -> dict:
    out = {
        "name": "distill", "model_path": str(model_dir), "seed": 1, "steps": 2,
        "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
        "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 4}},
        "trainer": {"lr": 1e-3, "temperature": 1.0, **(trainer or {})},
        "eval": {"every": 0, "heldout_size": 16},
    }
    if teacher is not None:
        out["teacher"] = teacher
    return out


def submit_refused(url: str, body: dict) -> list[dict]:
    before = len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"])
    r = http.post(f"{url}/v1/runs", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"]) == before
    return r.json()["fields"]


def test_a_teacher_with_another_vocabulary_is_422_naming_the_first_differing_token(lone_coordinator,
                                                                                     tiny_model_dir, other_vocab_dir):
    fields = submit_refused(lone_coordinator.url, spec(tiny_model_dir, {"model_path": str(other_vocab_dir)}))
    assert [f["field"] for f in fields] == ["teacher.model_path"], fields
    # Ids 0-13 agree (special tokens, then the digits); the default vocabulary has 'a' at 14, this one '+'.
    assert "id 14" in fields[0]["reason"] and "'a'" in fields[0]["reason"] and "'+'" in fields[0]["reason"], fields


@pytest.mark.parametrize("teacher, field", [
    ({"model_path": "/etc"}, "teacher.model_path"),                     # outside the model roots
    ({"model_path": "{missing}"}, "teacher.model_path"),                # inside them, not there
    ({"model_path": "{teacher}", "placement": "scorer"}, "teacher.placement"),
    ({"model_path": "{teacher}", "kl_weight": 0.0}, "teacher.reward_weight"),
    ({"model_path": "{teacher}", "discount": 1.5}, "teacher.discount"),
    ({"model_path": "{teacher}", "kl_weight": "1"}, "teacher.kl_weight"),
])
def test_hostile_teacher_settings_are_422_naming_the_field(lone_coordinator, tiny_model_dir, teacher_dir, tmp_path,
                                                           teacher, field):
    path = teacher["model_path"].format(missing=tmp_path / "nope", teacher=teacher_dir)
    fields = submit_refused(lone_coordinator.url, spec(tiny_model_dir, {**teacher, "model_path": path}))
    assert any(f["field"] == field or f["field"].startswith(field + ".") for f in fields), fields


def test_trainer_teacher_alone_is_refused(lone_coordinator, tiny_model_dir, teacher_dir):
    body = spec(tiny_model_dir, None, {"teacher": {"model_path": str(teacher_dir)}})
    fields = submit_refused(lone_coordinator.url, body)
    assert [f["field"] for f in fields] == ["trainer.teacher"], fields


def test_a_valid_teacher_reaches_the_trainers_configuration(tiny_model_dir, teacher_dir):
    import json

    body = spec(tiny_model_dir, {"model_path": str(teacher_dir), "reward_weight": 0.5, "discount": 0.25})
    parsed = parse_run_spec(json.dumps(body).encode())
    assert parsed.trainer.teacher == parsed.teacher
    assert (parsed.teacher.kl_weight, parsed.teacher.reward_weight, parsed.teacher.discount) == (1.0, 0.5, 0.25)
    # The stored spec validates again as itself (trainer.teacher repeating the top-level teacher).
    assert RunSpec.model_validate_json(parsed.model_dump_json()) == parsed
    with pytest.raises(RunSpecError, match="trainer.teacher"):
        stored = json.loads(parsed.model_dump_json())
        stored["trainer"]["teacher"]["discount"] = 0.5
        parse_run_spec(json.dumps(stored).encode())
