"""SGLang engine pieces that need no server: request bodies, response checks, the command
line, config validation and the synced checkpoint.

Here the weight-sync and LoRA request bodies are checked field by field; the broadcast bodies are
also built into sglang's own io_struct types and run against the CPU server over gloo
(tests/rollout/sglang/test_sglang_broadcast.py), the LoRA ones built into those types
(tests/rollout/sglang/test_sglang_lora.py: SGLang's LoRA layers need a GPU).
"""
from __future__ import annotations

import os

import json

import pytest
import torch

from contract.engine_options import SGLangEngineConfig
from contract.sglang_command import API_KEY_ENV, BOOTSTRAP, engine_run_options, server_command
from services.common.platform import Platform, SGLangPlatformConfig, sglang_launch_plan
from services.rollout.sglang.client import (
    SGLangRequestError,
    check_request,
    continuation_seed,
    generate_body,
    init_weights_update_group_body,
    load_lora_adapter_body,
    parse_generate_response,
    update_weights_from_disk_body,
    update_weights_from_distributed_body,
)
from services.rollout.sglang.config import SGLangHostConfig
from services.rollout.sglang.server import server_env
from services.rollout.sglang.weights import checkpoint_specs, verify_tensors, write_checkpoint
from services.rollout.types import GenerationRequest, PromptSpec, ResumedSample, SamplingConfig

REQ = GenerationRequest(
    prompts=(PromptSpec("a", (1, 5, 6), seed=10), PromptSpec("b", (1, 7), seed=99)),
    sampling=SamplingConfig(temperature=0.7, top_p=0.9, max_new_tokens=4, stop_token_ids=(2,)),
    samples_per_prompt=2,
)


def test_generate_body_one_entry_per_sample_with_its_seed():
    body = generate_body(REQ)
    assert body["input_ids"] == [[1, 5, 6], [1, 5, 6], [1, 7], [1, 7]]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [10, 11, 99, 100]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["stream"] is False
    p = body["sampling_params"][0]
    assert p == {
        "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0,
        "ignore_eos": False, "stop_token_ids": [2], "skip_special_tokens": False, "no_stop_trim": True,
        "sampling_seed": 10,
    }


def _turn_body() -> dict:
    # Engine.sample_turns: each episode's whole context (prompt, earlier turns, observations) as input_ids,
    # seeded by the turn's seed; the reply's tokens are kept as sampled.
    from services.rollout.engine import Engine

    class Recording(Engine):
        name = "recording"

        def __init__(self):
            self.requests = []

        @classmethod
        def from_config_json(cls, text, service=None):
            return cls()

        def load(self, model_path, policy_version):
            pass

        def generate(self, request):
            self.requests.append(request)
            return parse_generate_response(request, [_out([7, 8], [-0.5, -0.25], "0"), _out([9], [-1.0], "0")], "0")

        def update_weights(self, tensors, policy_version, *, finite_checked=False):
            pass

        @property
        def policy_version(self):
            return 0

    engine = Recording()
    cfg = SamplingConfig(temperature=0.7, max_new_tokens=4, stop_token_ids=(2,))
    turns = engine.sample_turns([[1, 5, 6, 30, 31], [1, 7]], [2**63 + 1, 5], cfg)
    body = generate_body(engine.requests[0])
    assert body["input_ids"] == [[1, 5, 6, 30, 31], [1, 7]]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [1, 5]  # SGLang reads seeds mod 2**63
    assert [t.token_ids for t in turns] == [[7, 8], [9]]
    return body


def test_a_turn_of_multi_turn_episodes_is_one_generate_of_their_contexts():
    _turn_body()


def test_a_turns_body_fits_sglangs_request_type(sglang_request_types):
    # Also a body asking for routed experts (MoE routing replay, tests/rollout/sglang/test_sglang_moe.py).
    bodies = [_turn_body(), generate_body(REQ, routed_experts=True)]
    assert bodies[1]["return_routed_experts"] is True
    # Each body becomes the type SGLang's HTTP handler decodes /generate into: an unknown field is a TypeError.
    for body in bodies:
        assert sglang_request_types.changed_fields("GenerateReqInput", body) == []  # every field kept its value


def test_greedy_and_top_k_map_to_sglang_conventions():
    greedy = GenerationRequest(prompts=(PromptSpec("g", (1,), seed=0),),
                               sampling=SamplingConfig(greedy=True, top_k=5, max_new_tokens=1))
    p = generate_body(greedy)["sampling_params"][0]
    assert p["temperature"] == 0.0 and p["top_k"] == 5


def _out(ids, logps, version="3", finish="length"):
    return {"output_ids": ids, "meta_info": {
        "weight_version": version, "finish_reason": {"type": finish},
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(logps, ids, strict=True)]}}


def test_parse_response_in_prompt_then_sample_order():
    outs = [_out([4], [-1.0]), _out([2], [-0.5], finish="stop"), _out([3, 3], [-2.0, -2.5]), _out([8], [-0.1])]
    samples = parse_generate_response(REQ, outs, "3")
    assert [s.sample_id for s in samples] == ["a/0", "a/1", "b/0", "b/1"]
    assert samples[1].finish_reason == "stop" and samples[2].logprobs == [-2.0, -2.5]


def test_parse_response_refuses_another_weight_version():
    outs = [_out([4], [-1.0])] * 3 + [_out([4], [-1.0], version="2")]
    with pytest.raises(SGLangRequestError, match="b/1 was generated with weight_version '2'"):
        parse_generate_response(REQ, outs, "3")


def test_parse_response_refuses_a_token_span_of_another_weight_version():
    # SGLang lists the versions a request's tokens came from; the final weight_version alone can hide an
    # update that landed mid-request.
    outs = [_out([4], [-1.0])] * 4
    outs[2] = {**outs[2], "meta_info": {**outs[2]["meta_info"], "weight_versions": [
        {"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 1}]}}
    with pytest.raises(SGLangRequestError, match="b/0 was generated with weight_version '2'"):
        parse_generate_response(REQ, outs, "3")


def test_an_abort_is_a_pause_only_when_the_engine_asked_for_one():
    outs = [_out([4], [-1.0]), _out([], [], finish="abort"), _out([3, 3], [-2.0, -2.5]), _out([8], [-0.1])]
    with pytest.raises(SGLangRequestError, match="a/1: finish_reason"):
        parse_generate_response(REQ, outs, "3")
    samples = parse_generate_response(REQ, outs, "3", pause_asked=True)
    assert samples[1].finish_reason == "paused" and samples[1].token_ids == []
    assert samples[2].policy_versions == [3, 3]


RESUMED = (ResumedSample("b/1", (9, 10), (-0.5, -0.25), (1, 2)),)


def test_a_resumed_sample_is_sent_with_its_tokens_and_continued_from_them():
    req = GenerationRequest(prompts=REQ.prompts, sampling=REQ.sampling, samples_per_prompt=2, resumed=RESUMED)
    body = generate_body(req)
    assert body["input_ids"][3] == [1, 7, 9, 10] and body["input_ids"][2] == [1, 7]
    assert body["sampling_params"][3]["max_new_tokens"] == 2 and body["sampling_params"][2]["max_new_tokens"] == 4
    # Not the seed of its first request (whose draws the two tokens already used), and not another sample's.
    assert body["sampling_params"][3]["sampling_seed"] == continuation_seed(100, 2) not in (100, 99, 10, 11)
    outs = [_out([4], [-1.0]), _out([2], [-0.5], finish="stop"), _out([3], [-2.0]), _out([2], [-0.1], finish="stop")]
    s = parse_generate_response(req, outs, "3")[3]
    assert (s.token_ids, s.logprobs, s.policy_versions) == ([9, 10, 2], [-0.5, -0.25, -0.1], [1, 2, 3])


def test_sample_ids_send_and_parse_only_those_samples():
    req = GenerationRequest(prompts=REQ.prompts, sampling=REQ.sampling, samples_per_prompt=2, resumed=RESUMED,
                            sample_ids=("a/0", "b/1"))
    body = generate_body(req)
    assert body["input_ids"] == [[1, 5, 6], [1, 7, 9, 10]]
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [10, continuation_seed(100, 2)]
    with pytest.raises(SGLangRequestError, match="expected 2 outputs, got 4"):
        parse_generate_response(req, [_out([4], [-1.0])] * 4, "3")
    got = parse_generate_response(req, [_out([4], [-1.0]), _out([2], [-0.1], finish="stop")], "3")
    assert [(s.group_id, s.index, s.token_ids) for s in got] == [("a", 0, [4]), ("b", 1, [9, 10, 2])]


def test_a_resumed_sample_with_a_token_outside_the_vocabulary_is_refused():
    req = GenerationRequest(prompts=REQ.prompts, sampling=REQ.sampling, samples_per_prompt=2, resumed=(
        ResumedSample("a/0", (9, 64), (-0.5, -0.5), (1, 1)),))
    with pytest.raises(ValueError, match=r"resumed\[0\].response_token_ids: id 64 outside the vocabulary \[0, 64\)"):
        check_request(req, vocab=64, max_len=None, eos={2})
    check_request(req, vocab=65, max_len=None, eos={2})


@pytest.mark.parametrize("resumed, field", [
    (ResumedSample("c/0", (9,), (-0.5,), (1,)), "resumed[0].sample_id"),
    (ResumedSample("a/0", (9, 9, 9, 9), (-0.5,) * 4, (1,) * 4), "resumed[0].response_token_ids"),
    (ResumedSample("a/0", (9,), (-0.5,), (1, 1)), "resumed[0]: 1 tokens"),
])
def test_a_resumed_sample_the_request_cannot_continue_is_refused(resumed, field):
    req = GenerationRequest(prompts=REQ.prompts, sampling=REQ.sampling, samples_per_prompt=2, resumed=(resumed,))
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        generate_body(req)


def test_parse_response_refuses_wrong_count_and_mismatched_logprob_ids():
    with pytest.raises(SGLangRequestError, match="expected 4 outputs, got 1"):
        parse_generate_response(REQ, [_out([4], [-1.0])], "3")
    bad = _out([4, 5], [-1.0, -1.0])
    bad["meta_info"]["output_token_logprobs"][1][1] = 6
    with pytest.raises(SGLangRequestError, match="do not match output_ids"):
        parse_generate_response(REQ, [bad] * 4, "3")


def test_weight_sync_bodies():
    assert update_weights_from_disk_body("/w/v7", "7") == {
        "model_path": "/w/v7", "weight_version": "7", "flush_cache": True, "abort_all_requests": False,
    }
    assert init_weights_update_group_body("10.0.0.1", 29500, 1, 2) == {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2,
        "group_name": "weight_update_group", "backend": "nccl",
    }
    assert update_weights_from_distributed_body(["a.w", "b.w"], ["bfloat16", "float32"], [(2, 3), [4]], "8") == {
        "names": ["a.w", "b.w"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
        "group_name": "weight_update_group", "flush_cache": True, "abort_all_requests": False,
        "weight_version": "8",
    }
    assert load_lora_adapter_body("policy", "/w/lora-3") == {"lora_name": "policy", "lora_path": "/w/lora-3", "pinned": False}


def test_weight_sync_bodies_refuse_bad_values():
    with pytest.raises(ValueError, match="rank_offset"):
        init_weights_update_group_body("h", 29500, 0, 2)
    with pytest.raises(ValueError, match="master_port"):
        init_weights_update_group_body("h", 0, 1, 2)
    with pytest.raises(ValueError, match="names/dtypes/shapes"):
        update_weights_from_distributed_body(["a"], [], [[1]], "1")
    with pytest.raises(ValueError, match="lora_name"):
        load_lora_adapter_body("", "/p")


def test_server_command_and_environment_exactly():
    plan = sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(), {})
    cmd = server_command("/v/bin/python", plan, model_path="/m", host="127.0.0.1", port=30001,
                         weight_version="5", run_options=engine_run_options(SGLangEngineConfig()),
                         extra_args=["--random-seed", "1"], parent_pid=4242)
    assert cmd == [
        "/v/bin/python", "-c", BOOTSTRAP, "4242", "--host=127.0.0.1", "--port=30001", "--weight-version=5",
        "--skip-tokenizer-init", "--device=cpu", "--attention-backend=torch_native", "--disable-cuda-graph",
        "--dtype=float32", "--skip-server-warmup", "--sleep-on-idle", "--enable-metrics",
        "--model-path=/m", "--max-total-tokens=8192", "--tp-size=1",  # the run's, one element each
        "--random-seed", "1",  # the operator's sglang_extra_args, as given
    ]
    env = server_env(plan, {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "HOME": "/root", "LOCKSTEP_AUTH_TOKEN": "t",
                            "LOCKSTEP_AUTH_TOKEN_FILE": "/run/secrets/t"}, "k" * 43)
    # Unscaled log-probs would break the temperature contract: never passed on; nor is Lockstep's own
    # token, which the server has no use for. The server's API key travels in the environment only.
    assert env == {"HOME": "/root", "LOCKSTEP_SGLANG_CPU_PLATFORM": "1", "SGLANG_PLATFORM": "lockstep_cpu",
                   API_KEY_ENV: "k" * 43}
    assert "k" * 43 not in " ".join(cmd) and "--api-key" not in cmd


def test_engine_config_names_the_bad_field():
    with pytest.raises(ValueError, match=r"engine_config\.server\.dtype"):
        SGLangEngineConfig.from_json(json.dumps({"server": {"dtype": "int3"}}))
    with pytest.raises(ValueError, match=r"engine_config\.bogus"):
        SGLangEngineConfig.from_json('{"bogus": 1}')
    with pytest.raises(ValueError, match=r"engine_config\.platform"):
        SGLangEngineConfig.from_json('{"platform": "tpu"}')
    with pytest.raises(ValueError, match="not valid JSON"):
        SGLangEngineConfig.from_json("{")
    for name, f in SGLangEngineConfig.model_fields.items():
        assert f.description, f"{name} has no description"


def test_checkpoint_verify_and_write(tmp_path):
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    save_file({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, str(base / "model.safetensors"))
    (base / "config.json").write_text('{"tie_word_embeddings": false}')
    (base / "tokenizer.json").write_text("{}")
    specs = checkpoint_specs(base)
    with pytest.raises(ValueError, match=r"missing \['b'\].*unknown \['x'\]"):
        verify_tensors({"w": torch.ones(2, 3), "x": torch.ones(1)}, specs, tied=False)
    with pytest.raises(ValueError, match=r"tensors\['w'\]: shape \(3, 2\)"):
        verify_tensors({"w": torch.ones(3, 2), "b": torch.ones(3)}, specs, tied=False)
    with pytest.raises(ValueError, match="NaN or Inf"):
        verify_tensors({"w": torch.full((2, 3), float("nan")), "b": torch.ones(3)}, specs, tied=False)
    sent = verify_tensors({"w": torch.ones(2, 3), "b": torch.ones(3)}, specs, tied=False)
    out = write_checkpoint(sent, base, tmp_path / "v1")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert checkpoint_specs(out)["w"] == ((2, 3), torch.float32)
    assert not list(tmp_path.glob(".v1.tmp-*"))
    with pytest.raises(FileExistsError):
        write_checkpoint(sent, base, tmp_path / "v1")


def test_a_fixed_port_is_given_up_by_the_previous_engine(tmp_path):
    """The rollout service loads a run's engine before closing the previous one; with a fixed
    port (compose) the previous engine must release it or the new server could never bind."""
    from recipes.tiny_model import build_model_dir
    from services.rollout.engine import EngineUnavailable
    from services.rollout.sglang.engine import _PORT_HOLDERS, SGLangEngine

    model = build_model_dir(tmp_path / "m", seed=0)
    cfg = SGLangEngineConfig(platform="cpu")
    host = SGLangHostConfig(weights_dir=str(tmp_path / "w"), python=str(tmp_path / "no-python"), server_port=30123)
    old, new = SGLangEngine(cfg, host), SGLangEngine(cfg, host)
    _PORT_HOLDERS[("127.0.0.1", 30123)] = old
    with pytest.raises(FileNotFoundError, match="make sglang-venv"):  # fails loud: no interpreter, no fallback
        new.load(str(model), 0)
    with pytest.raises(EngineUnavailable, match="replaced by a newer engine on port 30123"):
        old.generate(REQ)


def test_server_bootstrap_hands_over_an_api_key_that_starts_with_a_dash(tmp_path):
    """Generated keys are URL-safe base64, so one in 64 starts with '-': SGLang's argparse must still read it
    as the value of --api-key, not as another option (the server exited with code 2 when it did)."""
    import argparse  # noqa: F401 - the stand-in server below parses its argv as SGLang's does
    import subprocess
    import sys

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    out = tmp_path / "key"
    (fake / "launch_server.py").write_text(
        "import argparse, sys\n"
        "ap = argparse.ArgumentParser()\n"
        "ap.add_argument('--model-path')\n"
        "ap.add_argument('--api-key')\n"
        f"open({str(out)!r}, 'w').write(ap.parse_args().api_key)\n"
    )
    key = "-Xq3" + "a" * 39
    # Its own session, and this process as the parent its watchdog follows (as SGLangServer.start does).
    done = subprocess.run([sys.executable, "-c", BOOTSTRAP, str(os.getpid()), "--model-path=/m"],
                          capture_output=True, text=True, timeout=60, start_new_session=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path / "fake"), API_KEY_ENV: key})
    assert done.returncode == 0, done.stderr
    assert out.read_text() == key


def test_server_bootstrap_takes_its_group_down_when_the_rollout_service_dies(tmp_path):
    """A rollout service killed with SIGKILL can't stop its server; the bootstrap's watchdog does.

    A stand-in `sglang.launch_server` (sleeps, with a forked child like SGLang's
    scheduler) runs under the real BOOTSTRAP, launched by a parent process that
    is then SIGKILLed.
    """
    import signal
    import subprocess
    import sys
    import time

    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(
        "import os, sys, time\n"
        "pids = sys.argv[sys.argv.index('--pids-file') + 1]\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(600); os._exit(0)\n"
        "open(pids, 'w').write(f'{os.getpid()} {child}')\n"
        "time.sleep(600)\n"
    )
    pids_file = tmp_path / "pids"
    # The parent stands in for the rollout service: start_new_session like SGLangServer.start.
    parent_code = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {BOOTSTRAP!r}, str(os.getpid()), '--pids-file', {str(pids_file)!r}],"
        f" env={{**os.environ, 'PYTHONPATH': {str(tmp_path / 'fake')!r}, {API_KEY_ENV!r}: 'k'}},"
        " start_new_session=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 30
        while not (pids_file.exists() and pids_file.read_text().strip()):
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.1)
        server, child = (int(x) for x in pids_file.read_text().split())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while any(_running(p) for p in (server, child)):
            assert time.monotonic() < deadline, "server group outlived the dead rollout service"
            time.sleep(0.2)
    finally:
        if parent.poll() is None:
            parent.kill()


def _running(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
