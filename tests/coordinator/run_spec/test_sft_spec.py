"""A kind 'sft' run spec at a real coordinator's REST edge: hostile datasets are a 422 naming the file, the
line or row and the field, and nothing is stored; start_from names a run that must exist and have a
checkpoint. The reader's masks (completion tokens only, assistant turns of a chat through the model's own
template) are checked on the reader itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from recipes.tiny_model import build_model_dir
from services.coordinator.sft.dataset import SftSpec, read_sft_dataset

http = httpx.Client()
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(autouse=True, scope="module")
def _authenticated(lone_coordinator):
    http.headers.update(lone_coordinator.headers)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    model = build_model_dir(tmp_path_factory.mktemp("chat") / "m", seed=0)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return model


def spec(model: Path, path: Path, **over) -> dict:
    return {"name": "sft", "kind": "sft", "model_path": str(model), "steps": 2,
            "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
            "sft": {"path": str(path), "batch_size": 4}, "eval": {"every": 0, "heldout_size": 16}, **over}


def refused(url: str, body: dict) -> list[dict]:
    before = len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"])
    r = http.post(f"{url}/v1/runs", json=body, timeout=60)
    assert r.status_code == 422, r.text
    assert len(http.get(f"{url}/v1/runs", timeout=30).json()["runs"]) == before
    return r.json()["fields"]


GOOD = json.dumps({"prompt": "1+2=", "completion": "3"}) + "\n"
CHAT = {"messages": [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]}


@pytest.mark.parametrize("name, content, where", [
    ("missing.jsonl", GOOD + json.dumps({"prompt": "4+4="}) + "\n", "line 2: field 'completion' missing"),
    ("typed.jsonl", GOOD * 2 + json.dumps({"prompt": "4+4=", "completion": 8}) + "\n",
     "line 3: field 'completion' is int"),
    ("latin1.jsonl", GOOD.encode() + '{"prompt": "caf\u00e9", "completion": "1"}\n'.encode("latin-1"),
     "line 2: not UTF-8"),
    ("notjson.jsonl", GOOD + "{prompt: 1}\n", "line 2: not JSON"),
    ("role.jsonl", json.dumps(CHAT) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]}) + "\n",
     "line 2: messages[1].role: unknown role 'robot'"),
    ("noanswer.jsonl", json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n",
     "line 1: messages has no assistant message"),
    ("table.csv", "prompt,completion\n1+2=,3\n", "neither JSON Lines"),
])
def test_a_hostile_dataset_is_422_naming_file_line_and_field(lone_coordinator, chat_model, tmp_path, name, content,
                                                             where):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    fields = refused(lone_coordinator.url, spec(chat_model, path))
    assert [f["field"] for f in fields] == ["sft.path"], fields
    assert f"{path} {where}" in fields[0]["reason"] or (where in fields[0]["reason"] and str(path) in
                                                         fields[0]["reason"]), fields


def test_a_hostile_parquet_row_is_named(lone_coordinator, chat_model, tmp_path):
    import datasets

    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"prompt": "1+1=", "completion": "2"}, {"prompt": None, "completion": "4"}]) \
        .to_parquet(str(path))
    fields = refused(lone_coordinator.url, spec(chat_model, path))
    assert f"{path} row 2: field 'prompt' missing" in fields[0]["reason"], fields


@pytest.mark.parametrize("over, field", [
    ({"sft": None}, "sft"),
    ({"kind": "rl", "steps": 2}, "sft"),
    ({"teacher": {"model_path": "{model}"}}, "teacher"),
    ({"trainer": {"objective": "policy_gradient"}}, "trainer.objective"),
    ({"sft": {"path": "/etc/passwd"}}, "sft.path"),
])
def test_inconsistent_sft_specs_are_422_naming_the_field(lone_coordinator, chat_model, tmp_path, over, field):
    path = tmp_path / "good.jsonl"
    path.write_text(GOOD)
    body = spec(chat_model, path)
    for key, value in over.items():
        body[key] = json.loads(json.dumps(value).replace("{model}", str(chat_model)))
    if body["sft"] is None:
        del body["sft"]
    fields = refused(lone_coordinator.url, body)
    assert any(f["field"] == field or f["field"].startswith(field + ".") for f in fields), fields


@pytest.mark.parametrize("start, field", [({"run": "no-such-run"}, "start_from.run"),
                                          ({"run": "x", "step": 0}, "start_from.step")])
def test_start_from_must_name_a_run_with_a_checkpoint(lone_coordinator, tiny_model_dir, start, field):
    body = {"name": "after", "start_from": start, "steps": 1,
            "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}}}
    fields = refused(lone_coordinator.url, body)
    assert [f["field"] for f in fields] == [field], fields


def test_completion_tokens_alone_are_in_the_loss(chat_model, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(GOOD)
    [pair] = read_sft_dataset(SftSpec(path=str(pairs)), chat_model)
    assert (pair.prompt_ids, pair.response_ids[:-1], pair.loss_mask) == ([5, 76, 6, 84], [7], None)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [*CHAT["messages"], {"role": "user", "content": "2+2="},
                                             {"role": "assistant", "content": "4"}]}) + "\n")
    [conversation] = read_sft_dataset(SftSpec(path=str(chat)), chat_model)
    # "u:1+2=\na:" is the prompt; then "3\n" (loss), "u:2+2=\na:" (context), "4\n" (loss).
    assert len(conversation.prompt_ids) == len("u:1+2=\na:")
    assert conversation.loss_mask == [True, True] + [False] * len("u:2+2=\na:") + [True, True]
