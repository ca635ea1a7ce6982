"""The run spec's `reward` section: every refusal names its field, a scorer cannot be pointed outside the
operator's fleet or model roots, and what is valid round-trips as a stored spec.

Checked through the coordinator's own edge (run_spec.parse_run_spec with confined_run_spec, the class the REST
API validates with), plus one submit through a real coordinator with no scorer replicas: 422, nothing stored.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from recipes.char_tokenizer import PAD_ID
from recipes.tiny_model import build_model_dir
from services.coordinator.run_spec import RunSpec, RunSpecError, confined_run_spec, parse_run_spec

FLEET = ("127.0.0.1:7001", "127.0.0.1:7002")
JUDGE = {"template": "Q: {prompt}\nA: {response}\nRef: {reference}\nScore 0-10:",
         "parser": {"kind": "regex", "pattern": r"(\d+)"}, "score_range": {"low": 0, "high": 10}}


def reward_model_dir(root: Path) -> Path:
    """A tiny one-label sequence classifier directory (config only matters to the spec's checks)."""
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from recipes.tiny_judge.reward_model import save

    config = Qwen3Config(vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=1,
                         pad_token_id=PAD_ID, architectures=["Qwen3ForSequenceClassification"])
    return save(Qwen3ForSequenceClassification(config), root / "rm")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_spec")
    return {"policy": build_model_dir(root / "policy", seed=0), "rm": reward_model_dir(root), "root": root,
            "spaced": build_model_dir(root / "judge dir", seed=0)}


def spec(dirs: dict, reward: dict) -> dict:
    return {"name": "rewarded", "model_path": str(dirs["policy"]), "steps": 2,
            "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2},
            "eval": {"every": 0, "heldout_size": 16}, "reward": reward}


def refused(dirs: dict, reward: dict, fleet=FLEET) -> list[dict]:
    confined = confined_run_spec([str(dirs["root"])], [str(dirs["root"])], fleet)
    with pytest.raises(RunSpecError) as info:
        parse_run_spec(json.dumps(spec(dirs, reward)).encode(), confined)
    return info.value.fields


def accepted(dirs: dict, reward: dict) -> RunSpec:
    confined = confined_run_spec([str(dirs["root"])], [str(dirs["root"])], FLEET)
    return parse_run_spec(json.dumps(spec(dirs, reward)).encode(), confined)


def test_a_reward_model_and_a_judge_and_their_combination_are_accepted_and_round_trip(dirs):
    rm = {"kind": "reward_model", "reward_model": {"model_path": str(dirs["rm"]), "replicas": [FLEET[0]]}}
    parsed = accepted(dirs, rm)
    assert parsed.reward.sources() == {"reward_model": 1.0}
    assert RunSpec.model_validate_json(parsed.model_dump_json()).model_dump() == parsed.model_dump()
    judge = {"kind": "judge", "judge": {"model_path": str(dirs["policy"]), **JUDGE}}
    assert accepted(dirs, judge).reward.judge.max_new_tokens == 64
    both = {"kind": "combination", "weights": {"rule": 0.5, "reward_model": 0.25, "judge": 0.25},
            "reward_model": {"model_path": str(dirs["rm"]), "replicas": [FLEET[0]]},
            "judge": {"model_path": str(dirs["policy"]), "replicas": [FLEET[1]], **JUDGE}}
    parsed = accepted(dirs, both)
    assert parsed.reward.sources() == {"rule": 0.5, "reward_model": 0.25, "judge": 0.25}
    assert parsed.reward.model_sources() == ["reward_model", "judge"]
    assert accepted(dirs, {}).reward.kind == "rule"  # the default: the task's rule, as before


@pytest.mark.parametrize("reward, field", [
    ({"kind": "reward_model"}, "reward.reward_model"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE}, "reward_model": {"model_path": "{rm}"}},
     "reward.reward_model"),
    ({"kind": "rule", "weights": {"rule": 1.0}}, "reward.weights"),
    ({"kind": "combination", "weights": {}}, "reward.weights"),
    ({"kind": "combination", "weights": {"reward_model": 1.0}}, "reward.reward_model"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{policy}"}}, "reward.reward_model.model_path"),
    ({"kind": "reward_model", "reward_model": {"model_path": "/etc"}}, "reward.reward_model.model_path"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{missing}"}}, "reward.reward_model.model_path"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}", "replicas": ["10.0.0.9:50051"]}},
     "reward.reward_model.replicas.0"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}", "replicas": [FLEET[0], FLEET[0]]}},
     "reward.reward_model.replicas"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}", "engine_options": {"dtype": "int4"}}},
     "reward.reward_model.engine_options"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}", "score_range": {"low": 1, "high": 0}}},
     "reward.reward_model.score_range"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "template": "Rate it: {answer}"}},
     "reward.judge.template"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "template": "{prompt} only"}},
     "reward.judge.template"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "parser": {"kind": "regex", "pattern": "(("}}},
     "reward.judge.parser.pattern"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "parser": {"kind": "json"}}},
     "reward.judge.parser"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "max_new_tokens": 0}},
     "reward.judge.max_new_tokens"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", "template": "{response}",
                                 "parser": {"kind": "json", "field": "score"}}}, "reward.judge.score_range"),
    ({"kind": "combination", "weights": {"reward_model": 1.0, "judge": 1.0},
      "reward_model": {"model_path": "{rm}"}, "judge": {"model_path": "{policy}", **JUDGE}},
     "reward.judge.replicas"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "engine": "vllm"}}, "reward.judge.engine"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "engine": "sglang",
                                 "engine_options": {"platform": "cpu", "python": "/bin/sh"}}},
     "reward.judge.engine_options"),
    ({"kind": "judge", "judge": {"model_path": "{policy}", **JUDGE, "engine": "torch",
                                 "engine_options": {"platform": "cpu"}}}, "reward.judge.engine_options"),
    ({"kind": "judge", "judge": {"model_path": "{spaced}", **JUDGE, "engine": "sglang"}}, "reward.judge.model_path"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}", "engine": "torch"}}, "reward.reward_model.engine"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}"}, "max_attempts": 0}, "reward.max_attempts"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}"}, "timeout_s": 0}, "reward.timeout_s"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}"}, "max_failed_fraction": 1.5},
     "reward.max_failed_fraction"),
    ({"kind": "reward_model", "reward_model": {"model_path": "{rm}"}, "shape": "x"}, "reward.shape"),
])
def test_a_bad_reward_section_is_refused_naming_the_field(dirs, reward, field):
    text = json.dumps(reward).replace("{policy}", str(dirs["policy"])).replace("{rm}", str(dirs["rm"])) \
        .replace("{missing}", str(dirs["root"] / "nope")).replace("{spaced}", str(dirs["spaced"]))
    fields = refused(dirs, json.loads(text))
    assert any(f["field"] == field or f["field"].startswith(field + ".") for f in fields), fields


def test_a_judge_names_its_engine_and_a_reward_model_on_sglang_is_refused_saying_why(dirs):
    judge = {"kind": "judge", "judge": {"model_path": str(dirs["policy"]), "engine": "sglang",
                                        "engine_options": {"platform": "cpu", "startup_timeout_s": 60}, **JUDGE}}
    parsed = accepted(dirs, judge)
    assert parsed.reward.judge.engine == "sglang" and parsed.reward.judge.engine_options["startup_timeout_s"] == 60
    assert RunSpec.model_validate_json(parsed.model_dump_json()).model_dump() == parsed.model_dump()
    assert accepted(dirs, {**judge, "judge": {**judge["judge"], "engine": "torch", "engine_options": {}}}
                    ).reward.judge.engine == "torch"
    fields = refused(dirs, {"kind": "reward_model", "reward_model": {"model_path": str(dirs["rm"]), "engine": "sglang"}})
    assert [f["field"] for f in fields] == ["reward.reward_model.engine"], fields
    assert "random initialization" in fields[0]["reason"] and "engine 'reward_model'" in fields[0]["reason"]


def test_a_model_reward_without_scorer_replicas_is_refused_naming_reward_kind(dirs):
    fields = refused(dirs, {"kind": "reward_model", "reward_model": {"model_path": str(dirs["rm"])}}, fleet=())
    assert [f["field"] for f in fields] == ["reward.kind"], fields
    assert "scorer_addresses" in fields[0]["reason"]


def test_a_model_reward_is_refused_for_a_supervised_run(dirs):
    body = spec(dirs, {"kind": "reward_model", "reward_model": {"model_path": str(dirs["rm"])}})
    body.update(kind="sft", sft={"path": str(dirs["root"] / "x.jsonl")})
    (dirs["root"] / "x.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    with pytest.raises(RunSpecError) as info:
        parse_run_spec(json.dumps(body).encode())
    assert "reward.kind" in [f["field"] for f in info.value.fields]


def test_a_coordinator_without_scorers_answers_422_and_stores_nothing(lone_coordinator, tiny_model_dir, dirs):
    headers = lone_coordinator.headers
    body = spec(dirs, {"kind": "reward_model", "reward_model": {"model_path": str(dirs["rm"])}})
    body["model_path"] = str(tiny_model_dir)
    before = len(httpx.get(f"{lone_coordinator.url}/v1/runs", headers=headers, timeout=30).json()["runs"])
    r = httpx.post(f"{lone_coordinator.url}/v1/runs", json=body, headers=headers, timeout=60)
    assert r.status_code == 422, r.text
    assert [f["field"] for f in r.json()["fields"]] == ["reward.kind"]
    assert len(httpx.get(f"{lone_coordinator.url}/v1/runs", headers=headers, timeout=30).json()["runs"]) == before
