"""The coordinator runs without torch: the contract it shares with trainer and rollout is torch-free.

The first test imports every module of the coordinator package (and the
CLI), parses run specs (trainer config and both engines' options included),
computes advantages, tokenizes and encodes token ids in a subprocess where
importing torch raises. The others check that
each torch-free piece is the same function as the torch side it stands in for.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from contract.engine_options import ENGINE_OPTIONS, TorchEngineConfig
from contract.wire_tensors import array_from_proto
from contract.wire_tensors import ids_to_proto as ids_to_proto_numpy
from contract.wire_tensors import logprobs_to_proto as logprobs_to_proto_numpy
from proto import lockstep_pb2 as pb
from recipes.char_tokenizer import save_char_tokenizer
from services.common.models.directory import load_tokenizer
from services.common.tensors import from_proto, ids_to_proto, logprobs_to_proto, to_proto
from services.rollout.registry import ENGINES
from tests.conftest import REPO_ROOT

BLOCK_TORCH = textwrap.dedent('''
    import importlib.abc
    import sys

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is blocked in this process")
            return None

    sys.meta_path.insert(0, BlockTorch())
''')

WITHOUT_TORCH = BLOCK_TORCH + textwrap.dedent('''
    import json, sys
    model_dir = sys.argv[1]
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker does not block")

    import importlib, pkgutil
    import services.coordinator
    for module in pkgutil.walk_packages(services.coordinator.__path__, "services.coordinator."):
        importlib.import_module(module.name)  # every module of the package, __main__, api and run_loop among them
    import services.cli.__main__
    from contract.advantages import group_advantages
    from contract.wire_tensors import array_from_proto, ids_to_proto
    from services.common.models.directory import load_tokenizer
    from services.coordinator.run_spec import RunSpecError, parse_run_spec

    def spec(**over):
        base = {"name": "torch-free", "model_path": model_dir, "seed": 1, "steps": 2,
                "task": {"name": "arithmetic", "options": {"digits": 2, "heldout_size": 16}},
                "rollout": {"prompts_per_step": 2, "samples_per_prompt": 2},
                "eval": {"every": 0, "heldout_size": 16}}
        base.update(over)
        return json.dumps(base).encode()

    trainer = {"lr": 1e-3, "lr_schedule": {"warmup_steps": 2, "decay": "cosine", "decay_steps": 10},
               "policy_loss": {"kind": "m2po"}, "mismatch_correction": {"mode": "truncate"},
               "attention": {"backend": "reference"}, "parity_gate": {"iw_max": 2.0},
               "lora": {"rank": 4, "alpha": 8.0}}
    run = parse_run_spec(spec(trainer=trainer, rollout={
        "engine": "torch", "prompts_per_step": 2, "samples_per_prompt": 2,
        "engine_options": {"dtype": "bfloat16", "device": "cuda:1", "logprob_backend": "reference"}}))
    assert run.trainer.lora.rank == 4 and run.trainer.lr_schedule.decay == "cosine"
    parse_run_spec(spec(rollout={"engine": "sglang", "prompts_per_step": 2, "samples_per_prompt": 2,
                                 "engine_options": {"tp_size": 2, "server": {"dtype": "bfloat16"}}}))
    refusals = {}
    for name, body in {
        "device": spec(rollout={"engine": "torch", "engine_options": {"device": "gpu"}}),
        "backend": spec(rollout={"engine": "torch", "engine_options": {"logprob_backend": "fast"}}),
        "sglang": spec(rollout={"engine": "sglang", "engine_options": {"python": "/bin/sh"}}),
        "lora": spec(trainer={"lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1}}),
        "gspo": spec(trainer={"policy_loss": {"kind": "gspo"}, "mismatch_correction": {"mode": "mask"}}),
    }.items():
        try:
            parse_run_spec(body)
        except RunSpecError as exc:
            refusals[name] = exc.fields
        else:
            raise SystemExit(f"{name}: accepted")

    tokenizer = load_tokenizer(model_dir)
    ids = tokenizer.encode("12+34=", add_special_tokens=False)
    print(json.dumps({
        "refusals": refusals,
        "advantages": group_advantages([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]),
        "ids": array_from_proto(ids_to_proto(ids), field="ids", dtype="int32", ndim=1).tolist(),
        "decoded": tokenizer.decode(ids),
        "eos": tokenizer.eos_token_id,
        "torch_modules": sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")),
    }))
''')


@pytest.fixture(scope="module")
def char_model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("char_model")
    save_char_tokenizer(out)
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    return out


def test_coordinator_imports_parses_and_scores_without_torch(char_model_dir):
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TORCH, str(char_model_dir)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["torch_modules"] == []
    reasons = {name: "; ".join(f"{f['field']}: {f['reason']}" for f in fields)
               for name, fields in got["refusals"].items()}
    assert "rollout.engine_options.device: " in reasons["device"] and "not a torch device name" in reasons["device"]
    assert "unknown backend 'fast'" in reasons["backend"]
    assert "python: set by the rollout service's configuration (sglang_python)" in reasons["sglang"]
    assert reasons["lora"].startswith("trainer.lora.dropout:")
    assert "policy_loss.kind: 'gspo'" in reasons["gspo"]
    assert got["advantages"] == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-5)
    tokenizer = load_tokenizer(char_model_dir)
    assert got["ids"] == tokenizer.encode("12+34=", add_special_tokens=False)
    assert got["decoded"] == "12+34=" and got["eos"] == 2


def test_blocker_blocks_what_the_coordinator_used_to_import():
    """The subprocess test is only as good as its blocker: the trainer's modules must fail under it."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import services.trainer.loss.surrogate"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "torch is blocked in this process" in proc.stderr


@pytest.mark.parametrize("values", [[], [0], [5, 17, 2, 2**31 - 1, -(2**31)]])
def test_token_ids_have_one_wire_format(values):
    torch_msg, numpy_msg = ids_to_proto(values), ids_to_proto_numpy(values)
    assert torch_msg.SerializeToString() == numpy_msg.SerializeToString()
    assert from_proto(numpy_msg, field="ids", dtype=torch.int32, ndim=1).tolist() == values
    assert array_from_proto(torch_msg, field="ids", dtype="int32", ndim=1).tolist() == values


def test_logprobs_have_one_wire_format():
    values = [-0.0, -1.5, -(2.0 ** -100), -87.3365478515625, float("-inf")]  # float32 values
    torch_msg, numpy_msg = logprobs_to_proto(values), logprobs_to_proto_numpy(values)
    assert torch_msg.SerializeToString() == numpy_msg.SerializeToString()
    assert from_proto(numpy_msg, field="lp", dtype=torch.float32).tolist() == values
    assert array_from_proto(torch_msg, field="lp", dtype="float32").tolist() == values


def test_bfloat16_decodes_to_the_same_values():
    t = torch.tensor([[1.0, -2.5], [3.140625, 1e-3]], dtype=torch.bfloat16)
    decoded = array_from_proto(to_proto(t), field="w")
    assert decoded.dtype == np.float32 and decoded.tolist() == t.float().tolist()


@pytest.mark.parametrize("msg, dtype, ndim", [
    (pb.Tensor(), None, None),
    (pb.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8), None, None),
    (pb.Tensor(dtype="float32", shape=[1], data=b"\0" * 4), "int32", None),
    (pb.Tensor(dtype="int32", shape=[1, 1], data=b"\0" * 4), "int32", 1),
    (pb.Tensor(dtype="int32", shape=[-1], data=b""), None, None),
    (pb.Tensor(dtype="int32", shape=[3], data=b"\0" * 8), "int32", 1),
])
def test_malformed_tensors_are_refused_alike(msg, dtype, ndim):
    torch_dtype = None if dtype is None else getattr(torch, dtype)
    with pytest.raises(ValueError) as by_torch:
        from_proto(msg, field="t", dtype=torch_dtype, ndim=ndim)
    with pytest.raises(ValueError) as by_numpy:
        array_from_proto(msg, field="t", dtype=dtype, ndim=ndim)
    assert str(by_torch.value) == str(by_numpy.value) and str(by_numpy.value).startswith("t")


@pytest.mark.parametrize("name", ["cpu", "cpu:0", "cuda", "cuda:0", "cuda:12", "mps", "meta", "xla:1", "gpu",
                                  "cuda:", "cuda:-1", "cuda:x", ":0", "CUDA", " cuda", "cuda:0:1", "cuda0"])
def test_device_names_are_checked_as_torch_checks_them(name):
    try:
        served = torch.device(name).type in ("cpu", "cuda")
    except (RuntimeError, ValueError):
        served = False
    try:
        TorchEngineConfig(device=name)
    except ValueError:
        accepted = False
    else:
        accepted = True
    assert accepted == served


def test_the_tokenizer_is_the_one_transformers_loads(char_model_dir):
    from transformers import AutoTokenizer

    reference, ours = AutoTokenizer.from_pretrained(str(char_model_dir)), load_tokenizer(char_model_dir)
    assert ours.eos_token_id == reference.eos_token_id
    for text in ["12+34=", "What is 7 * 8?\n", "héllo", ""]:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids + [2], skip_special_tokens=skip) == reference.decode(
                ids + [2], skip_special_tokens=skip)


def test_a_model_dir_without_a_fast_tokenizer_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model_path: .* has no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_the_contract_lists_every_rollout_engine():
    assert sorted(ENGINE_OPTIONS) == sorted(ENGINES)


@pytest.mark.parametrize("module", ["contract.trainer_settings", "contract.trainer_run", "contract.engine_options",
                                    "contract.command_line",
                                    "contract.platforms", "contract.advantages", "contract.wire_tensors",
                                    "services.common.models.directory", "services.coordinator.run_spec"])
def test_each_module_imports_first(module):
    """Imported first in a fresh interpreter, a module in an import cycle finds its partner half-built."""
    proc = subprocess.run([sys.executable, "-c", BLOCK_TORCH + f"import {module}"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
