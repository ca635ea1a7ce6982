"""Math runs from a JSONL file, the same problems as Parquet (other column names), and as chat-formatted
JSONL rendered by the model's chat template, on the shared stack: the same prompt token ids at every step
and the same metrics bit for bit (they learn alike), and the chat run's fingerprint names its template."""
from __future__ import annotations

import hashlib
import json
import random
import shutil

import pytest

pytestmark = pytest.mark.slow
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def data(warm_model, tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("prompt_data")
    model = root / "model"
    shutil.copytree(warm_model.path, model)  # the shared warm model is read only; this copy gets a template
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    rng = random.Random(0)
    pairs = [(rng.randrange(10, 50), rng.randrange(10, 50)) for _ in range(24)]
    (root / "plain.jsonl").write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                                              for a, b in pairs))
    pq.write_table(pa.Table.from_pylist([{"prompt_text": f"{a}+{b}=", "target": str(a + b)} for a, b in pairs]),
                   root / "verl.parquet")
    (root / "chat.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}) + "\n"
        for a, b in pairs))
    return root, model


def spec(model, name: str, options: dict) -> dict:
    return {
        "name": name, "model_path": str(model), "seed": 1, "steps": 2,
        "task": {"name": "math", "options": {"heldout_size": 4, "reward_workers": 1, "prompt_template": "{question}",
                                             **options}},
        "rollout": {"prompts_per_step": 4, "samples_per_prompt": 4, "sampling": {"max_new_tokens": 5}},
        "trainer": {"lr": 3e-4}, "eval": {"every": 0, "heldout_size": 4},
    }


def test_parquet_and_chat_runs_train_like_the_jsonl_run(data, one_replica_stack):
    root, model = data
    variants = {
        "jsonl": {"path": str(root / "plain.jsonl")},
        "parquet": {"path": str(root / "verl.parquet"), "question_field": "prompt_text", "answer_field": "target"},
        "chat": {"path": str(root / "chat.jsonl"), "dataset": {"messages_field": "messages"}},
    }
    client = one_replica_stack.client()
    try:
        seen = {}
        for name, options in variants.items():
            run = client.submit(spec(model, f"data-{name}", options))
            assert client.wait(run["id"], timeout_s=600)["status"] == "completed", client.run(run["id"])["error"]
            prompts = [[s["prompt_token_ids"] for s in client.samples(run["id"], step, limit=1000)["samples"]]
                       for step in (1, 2)]
            metrics = client.metrics(run["id"])
            seen[name] = (prompts, [s["metrics"] for s in metrics["steps"]], metrics["eval_initial"],
                          client.run(run["id"])["fingerprint"])
    finally:
        client.close()
    prompts, steps, eval_initial, fingerprint = seen.pop("jsonl")
    assert all(len(step) == 16 for step in prompts) and len({tuple(p) for p in prompts[0]}) == 4
    for name, (other_prompts, other_steps, other_eval, other_fingerprint) in seen.items():
        assert other_prompts == prompts, name
        assert other_steps == steps and other_eval == eval_initial, name
    assert "chat_template_sha256" not in fingerprint
    assert seen["chat"][3]["chat_template_sha256"] == hashlib.sha256(TEMPLATE.encode()).hexdigest()
