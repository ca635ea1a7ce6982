"""Rewards from models through the real stack (tests/integration/rewards/conftest.py): coordinator, trainer, a
policy replica and scorer replicas as processes, Redis, gRPC and REST between them.

- a run rewarded by a reward model, and one by a generative judge, complete; every trained trajectory's reward
  is the one the reward ledger records, traced to a Score call the scorer logged, and the scorer's identity is
  in the step record and the platform fingerprint;
- every Score call is authenticated, a policy replica refuses it, and a run spec cannot name a scorer outside
  the coordinator's fleet (422 naming the field).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import grpc
import httpx
import pytest

from proto import lockstep_pb2 as pb
from proto import lockstep_pb2_grpc as pb_grpc
from services.common.grpc.options import insecure_channel
from services.common.records.step_record import read_step_record

JUDGE_PATTERN = r"^(\d+)"


def base_spec(policy: Path, reward: dict, *, steps: int = 2, seed: int = 0) -> dict:
    return {"name": "rewarded", "model_path": str(policy), "seed": seed, "steps": steps,
            "task": {"name": "arithmetic", "options": {"seed": 0, "digits": 2, "heldout_size": 200}},
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4,
                        "sampling": {"temperature": 1.0, "max_new_tokens": 5}},
            "trainer": {"lr": 3e-4, "temperature": 1.0},
            "eval": {"every": 0, "heldout_size": 8}, "checkpoint": {"final": False},
            "debug": {"record_trajectories": True}, "reward": reward}


def run_to_end(stack, spec: dict) -> tuple[dict, list[dict]]:
    client = stack.client()
    try:
        run = client.submit(spec)
        done = client.wait(run["id"], timeout_s=600)
        return client.run(run["id"]), [s for s in client.metrics(run["id"])["steps"]]
    finally:
        client.close()


def trained(stack, run_id: str, step: int, tmp_path: Path) -> tuple[dict, list[pb.Trajectory]]:
    client = stack.client()
    try:
        path = tmp_path / f"{run_id}_{step}.pb"
        path.write_bytes(client.step_record(run_id, step))
    finally:
        client.close()
    meta, chunks = read_step_record(path)
    return json.loads(meta.reward_scorers_json), [c.trajectory for c in chunks if c.HasField("trajectory")]


def ledger(stack, run_id: str, step: int) -> tuple[dict, dict[str, dict]]:
    lines = (stack.run_dir / "coordinator" / run_id / "rewards" / f"step_{step:06d}.jsonl").read_text().splitlines()
    head, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
    return head, {r["sample_id"]: r for r in rows}


def files_sha256(model: Path) -> str:
    outer = hashlib.sha256()
    outer.update(b"model.safetensors\0" + hashlib.sha256((model / "model.safetensors").read_bytes()).digest())
    return outer.hexdigest()


def scored_calls(stack, scorer: int) -> set[str]:
    """Call ids the scorer replica logged as scored (its structured log)."""
    log = stack.run_dir / "logs" / f"scorer{scorer}.log"
    return {json.loads(line).get("call_id") for line in log.read_text().splitlines()
            if line.startswith("{") and '"scored"' in line}


def test_a_reward_model_run_completes_and_every_reward_traces_to_its_scorer_call(reward_stack, warm_model, tmp_path):
    stack = reward_stack.stack
    rm = {"kind": "reward_model", "reward_model": {"model_path": str(reward_stack.reward_model),
                                                   "replicas": [reward_stack.scorers[0]]}, "batch_size": 3}
    run, steps = run_to_end(stack, base_spec(warm_model.path, rm))
    assert run["status"] == "completed", run
    assert len(steps) == 2
    identity = {"source": "reward_model", "model_path": str(reward_stack.reward_model.resolve()),
                "weights_sha256": files_sha256(reward_stack.reward_model), "engine": "reward_model"}
    assert run["fingerprint"]["reward_scorers"] == [identity]
    calls = scored_calls(stack, 0)
    for step in (1, 2):
        scorers, trajectories = trained(stack, run["id"], step, tmp_path)
        assert scorers == [identity]
        head, rows = ledger(stack, run["id"], step)
        assert head["scorers"] == [identity]
        assert len(trajectories) == 8 and len({t.sample_id for t in trajectories}) == 8
        for t in trajectories:
            part = rows[t.sample_id]["parts"]["reward_model"]
            assert t.reward == pytest.approx(part["score"], abs=0, rel=1e-12)  # the reward is the model's score
            assert part["call_id"] in calls and part["call_id"].startswith(f"{run['id']}/s{step}/reward_model/")
            assert part["replica"] == reward_stack.scorers[0] and part["attempts"] == 1
        assert len({t.reward for t in trajectories}) > 1  # scores of a real model, not a constant
        m = steps[step - 1]["metrics"]
        assert m["reward_dropped"] == 0 and m["reward_failed_attempts"] == 0, m
    exported = httpx.get(f"{stack.api_url}/metrics", timeout=10).text
    scored = re.search(rf'lockstep_reward_scored_total{{cached="false",run_id="{run["id"]}",source="reward_model"}} '
                       r'(\S+)', exported)
    assert scored is not None and float(scored.group(1)) + _cached(exported, run["id"]) == 16


def _cached(exported: str, run_id: str) -> float:
    hit = re.search(rf'lockstep_reward_scored_total{{cached="true",run_id="{run_id}",source="reward_model"}} (\S+)',
                    exported)
    return float(hit.group(1)) if hit else 0.0


def test_a_judge_run_completes_with_its_template_and_parser(reward_stack, warm_model, tmp_path):
    # The demo policy as its own judge: the template asks it to add the response to the reference, and the
    # parser reads the number it writes. What matters is that the template is filled and the parser read.
    stack = reward_stack.stack
    judge = {"kind": "judge", "max_failed_fraction": 1.0, "judge": {
        "model_path": str(warm_model.path), "replicas": [reward_stack.scorers[0]],
        "template": "{response}+{reference}=", "parser": {"kind": "regex", "pattern": JUDGE_PATTERN},
        "score_range": {"low": 0, "high": 999}, "max_new_tokens": 4}}
    run, steps = run_to_end(stack, base_spec(warm_model.path, judge, steps=1, seed=1))
    assert run["status"] == "completed", run
    assert run["fingerprint"]["reward_scorers"][0]["template_sha256"] == hashlib.sha256(
        b"{response}+{reference}=").hexdigest()
    _, trajectories = trained(stack, run["id"], 1, tmp_path)
    _, rows = ledger(stack, run["id"], 1)
    assert len(rows) == 8
    trained_ids = {t.sample_id for t in trajectories}
    for sample_id, row in rows.items():
        part = row["parts"]["judge"]
        found = re.search(JUDGE_PATTERN, part["verdict"])
        if found is None:  # a verdict stating no number is dropped, never rewarded
            assert row["dropped"] == "unparsable" and sample_id not in trained_ids
        else:
            assert part["score"] == float(found.group(1)) and sample_id in trained_ids
    assert {t.sample_id: t.reward for t in trajectories} == {i: rows[i]["reward"] for i in trained_ids}
    m = steps[0]["metrics"]
    assert m["reward_dropped"] == 8 - len(trajectories) == m.get("reward_dropped_unparsable", 0)


def test_score_calls_are_authenticated_and_only_scorers_serve_them(reward_stack):
    stack = reward_stack.stack
    request = pb.ScoreRequest(run_id="x", items=[pb.ScoreItem(item_id="a", prompt="1+1=", response="2")])
    anonymous = grpc.insecure_channel(reward_stack.scorers[0])
    try:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.RolloutStub(anonymous).Score(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        anonymous.close()

    async def call(address: str, method: str, message):
        channel = insecure_channel(address, stack.token)
        try:
            return await getattr(pb_grpc.RolloutStub(channel), method)(message, timeout=10)
        finally:
            await channel.close()

    import asyncio

    for address, method, message in ((f"127.0.0.1:{stack.rollout_ports[0]}", "Score", request),
                                      (reward_stack.scorers[0], "Generate", pb.GenerateRequest(run_id="x"))):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(call(address, method, message))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "role" in info.value.details()


def test_a_scorer_outside_the_fleet_is_422_naming_the_field(reward_stack, warm_model):
    stack = reward_stack.stack
    client = stack.client()
    try:
        before = len(client.runs())
        body = base_spec(warm_model.path, {"kind": "reward_model", "reward_model": {
            "model_path": str(reward_stack.reward_model), "replicas": [f"127.0.0.1:{stack.rollout_ports[0]}"]}})
        r = httpx.post(f"{stack.api_url}/v1/runs", json=body, headers={"Authorization": stack.token.header},
                       timeout=60)
        assert r.status_code == 422, r.text
        assert [f["field"] for f in r.json()["fields"]] == ["reward.reward_model.replicas.0"]
        assert len(client.runs()) == before
    finally:
        client.close()
