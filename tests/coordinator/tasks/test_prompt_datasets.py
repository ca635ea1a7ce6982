"""Prompt datasets: JSONL, Parquet, a saved Hugging Face dataset and chat-formatted JSONL of the same problems
give the same prompt token ids (chats through the model's chat template, special tokens included), the same
deterministic splits, and malformed data is refused at submit naming the file, the row and the field."""
from __future__ import annotations

import hashlib
import json

import pytest

from recipes.char_tokenizer import save_char_tokenizer
from services.common.models.directory import load_tokenizer
from services.coordinator.run.step_context import PromptTokens
from services.coordinator.run_spec import RunSpecError, parse_run_spec
from services.coordinator.tasks import build_task
from services.coordinator.tasks.chat_template import ChatTemplate

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
PLAIN_TEMPLATE = "<|bos|>[system]Answer briefly.\n[user]{question}\n[assistant]"
ROWS = [{"q": f"What is {a} + {b}?", "a": str(a + b)} for a, b in [(2, 3), (10, 7), (4, 4), (31, 5), (8, 9), (6, 1)]]


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    save_char_tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("data")
    (root / "plain.jsonl").write_text("".join(json.dumps({"question": r["q"], "answer": r["a"]}) + "\n"
                                              for r in ROWS))
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": chat(r["q"]), "answer": r["a"]}) + "\n"
                                             for r in ROWS))
    # verl's layout: other column names, mapped by question_field / answer_field
    pq.write_table(pa.Table.from_pylist([{"problem": r["q"], "solution": r["a"], "extra": 1} for r in ROWS]),
                   root / "verl.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": chat(r["q"]), "answer": r["a"]}
                                                               for r in ROWS])}).save_to_disk(str(root / "hf"))
    return root


def options(path, **more) -> dict:
    return {"path": str(path), "heldout_size": 2, "seed": 3, "reward_workers": 1, **more}


VARIANTS = {
    "plain": lambda d: options(d / "plain.jsonl", prompt_template=PLAIN_TEMPLATE),
    "parquet": lambda d: options(d / "verl.parquet", prompt_template=PLAIN_TEMPLATE, question_field="problem",
                                 answer_field="solution"),
    "chat": lambda d: options(d / "chat.jsonl", dataset={"messages_field": "messages"}),
    "hf_chat": lambda d: options(d / "hf", dataset={"format": "hf_disk", "split": "train",
                                                    "messages_field": "prompt"}),
}


def prompt_ids(model_dir, opts: dict) -> dict[str, list[tuple[list[int], str]]]:
    task = build_task("math", opts)
    try:
        chat_template = ChatTemplate.from_model_dir(model_dir) if task.chat_prompts else None
        tokens = PromptTokens(load_tokenizer(model_dir), chat_template)
        return {split: [(tokens.encode(p), p.answer) for p in task.split(split)] for split in ("train", "heldout")}
    finally:
        task.close()


def test_every_format_gives_the_plain_jsonl_prompt_ids_and_splits(model_dir, files):
    ids = {name: prompt_ids(model_dir, make(files)) for name, make in VARIANTS.items()}
    plain = ids.pop("plain")
    assert len(plain["train"]) == 4 and len(plain["heldout"]) == 2
    assert plain["train"][0][0][0] == 1  # the chat template's bos_token, rendered and encoded as bos
    for name, got in ids.items():
        assert got == plain, name


def test_the_template_hash_is_the_rendered_templates(model_dir):
    template = ChatTemplate.from_model_dir(model_dir)
    assert template.sha256 == hashlib.sha256(TEMPLATE.encode()).hexdigest()
    assert template.render([("user", "hi")]) == "<|bos|>[user]hi\n[assistant]"


def submit(model_dir, opts: dict, **more) -> list[dict]:
    body = {"name": "t", "model_path": str(model_dir), "steps": 1, "task": {"name": "math", "options": opts},
            "rollout": {"prompts_per_step": 1, "samples_per_prompt": 2}, "eval": {"heldout_size": 1}, **more}
    with pytest.raises(RunSpecError) as err:
        parse_run_spec(json.dumps(body).encode())
    return err.value.fields


def test_malformed_rows_are_refused_naming_file_row_and_field(model_dir, files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": r["q"], "solution": r["a"]} for r in ROWS]
    rows[2]["solution"] = None
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    (reason,) = [f["reason"] for f in submit(model_dir, options(tmp_path / "bad.parquet", question_field="problem",
                                                                   answer_field="solution"))]
    assert f"answer_field: row 3 of {tmp_path / 'bad.parquet'} has no string field 'solution'" in reason

    lines = [{"messages": chat(r["q"]), "answer": r["a"]} for r in ROWS]
    lines[1]["messages"] = [{"role": "user", "content": 5}]
    (tmp_path / "bad_chat.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (reason,) = [f["reason"] for f in submit(model_dir, options(tmp_path / "bad_chat.jsonl",
                                                                   dataset={"messages_field": "messages"}))]
    assert f"dataset.messages_field: line 2 of {tmp_path / 'bad_chat.jsonl'}: messages[0] is not a" in reason

    fields = submit(model_dir, options(files / "verl.parquet", dataset={"format": "jsonl"}))
    assert fields[0]["field"] == "task.options" and "verl.parquet is not UTF-8" in fields[0]["reason"]
    fields = submit(model_dir, options(files / "hf", dataset={"split": "test"}))
    assert "has no split 'test'" in fields[0]["reason"]


def test_a_chat_the_template_cannot_render_or_a_model_without_one_is_refused(model_dir, files, tmp_path):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    strict = tmp_path / "strict"
    strict.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (strict / name).write_bytes((model_dir / name).read_bytes())
    (strict / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}")}))
    (field,) = submit(strict, options(files / "chat.jsonl", dataset={"messages_field": "messages"}))
    assert field["field"] == "task.options.dataset.messages_field"
    assert "cannot render chat.jsonl:" in field["reason"] and "no system turns" in field["reason"]

    del config["chat_template"]
    (strict / "tokenizer_config.json").write_text(json.dumps(config))
    (field,) = submit(strict, options(files / "chat.jsonl", dataset={"messages_field": "messages"}))
    assert field["field"] == "task.options.dataset.messages_field" and "has no chat template" in field["reason"]


def test_eval_sets_and_heldout_files_are_read_in_the_datasets_format(model_dir, files):
    from services.coordinator.tasks import read_eval_set

    parquet = VARIANTS["parquet"](files)
    plain = [(p.prompt, p.answer) for p in read_eval_set("math", VARIANTS["plain"](files), str(files / "plain.jsonl"),
                                                          "eval.sets.0.path")]
    assert [(p.prompt, p.answer) for p in read_eval_set("math", parquet, str(files / "verl.parquet"),
                                                        "eval.sets.0.path")] == plain
    task = build_task("math", {**parquet, "heldout_path": str(files / "verl.parquet")})
    try:
        assert [(p.prompt, p.answer) for p in task.split("heldout")] == plain
    finally:
        task.close()


def test_the_coordinator_answers_422_naming_file_row_and_field_and_stores_nothing(lone_coordinator, model_dir,
                                                                                  tmp_path):
    import httpx
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": r["q"], "answer": r["a"]} for r in ROWS]
    rows[4]["question"] = None  # a null cell
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    body = {"name": "t", "model_path": str(model_dir), "steps": 1,
            "task": {"name": "math", "options": options(tmp_path / "bad.parquet")}}
    with httpx.Client(base_url=lone_coordinator.url, headers=lone_coordinator.headers, timeout=60) as http:
        before = len(http.get("/v1/runs").json()["runs"])
        r = http.post("/v1/runs", json=body)
        assert r.status_code == 422, r.text
        (field,) = r.json()["fields"]
        assert field["field"] == "task.options"
        assert f"question_field: row 5 of {tmp_path / 'bad.parquet'} has no string field 'question'" in \
            field["reason"]
        assert len(http.get("/v1/runs").json()["runs"]) == before
