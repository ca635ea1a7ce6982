"""The SGLang server's command line: no value a run chose can be read as an option.

The rule (contract/command_line.py): a run's value keeps its grammar and is
rendered as one `--flag=value` element (a list as the flag then its items);
the builder checks it again at launch. Pure tests of that, then two against
the installed SGLang: its enumerations are the ones the models offer, and its
own argparse reads each rendered command line as the config says.
"""
from __future__ import annotations

import ast
import json
import subprocess
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from contract.command_line import (
    ARG_VALUE_PATTERN,
    SpecOption,
    check_arg_value,
    command_line_fields,
    render_spec_options,
)
from contract.engine_options import SGLangEngineConfig
from contract.platforms import CUDA_ATTENTION_BACKENDS, LORA_TARGET_MODULES
from contract.sglang_command import engine_run_options, engine_switches, server_command
from services.common.platform import Platform, SGLangLaunchPlan, SGLangPlatformConfig, sglang_launch_plan
from services.rollout.sglang.config import default_python
from tests.conftest import require, require_sglang_python

HOSTILE = ["--x", "-x", "a b", "a\x00b", "a\tb", "\u00a0x", "x\u2028", ""]


def test_run_values_render_as_one_element_each():
    options = [
        SpecOption("a", "--int", 4096), SpecOption("b", "--negative", -1), SpecOption("c", "--float", 0.4),
        SpecOption("d", "--word", "bfloat16"), SpecOption("e", "--one", ("all",)),
        SpecOption("f", "--many", ("q_proj", "v_proj")), SpecOption("g", "--path", "/m/-x=--y"),
    ]
    assert render_spec_options(options) == [
        "--int=4096", "--negative=-1", "--float=0.4", "--word=bfloat16", "--one=all",
        # argparse takes one value after '=', so a list of two follows its flag, each item checked.
        "--many", "q_proj", "v_proj", "--path=/m/-x=--y",
    ]


@pytest.mark.parametrize("value", [*HOSTILE, ("all", "--trust-remote-code"), ("q_proj", "-x"), ("a b",), (),
                                   True, float("nan"), float("inf"), None, ["all"]])
def test_the_builder_refuses_a_value_that_could_read_as_an_option(value):
    with pytest.raises(ValueError, match=r"^engine_config\.server\.x"):
        render_spec_options([SpecOption("engine_config.server.x", "--x", value)])


@pytest.mark.parametrize("flag", ["-x", "x", "--", "--x y", "--x=1", "--X"])
def test_the_builder_refuses_a_flag_that_is_not_a_flag_name(flag):
    with pytest.raises(ValueError, match="not a flag name"):
        render_spec_options([SpecOption("f", flag, 1)])


@pytest.mark.parametrize("value", HOSTILE)
def test_the_grammar_names_the_field_and_why(value):
    with pytest.raises(ValueError, match=r"^model_path: .* (starts with '-'|whitespace or NUL|is empty)"):
        check_arg_value(value, "model_path")


def _literals(annotation: object) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in typing.get_args(annotation) if isinstance(a, str)]
    return [v for a in typing.get_args(annotation) for v in _literals(a)]


def _declared(model: type[BaseModel]):
    for name, f in model.model_fields.items():
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from _declared(f.annotation)
    for name in command_line_fields(model):
        yield model, name


def test_every_enumerated_value_of_an_option_fits_the_grammar():
    # Generated from the models: an enumeration a run picks from must hold no value that reads as a flag.
    seen = 0
    for model, name in _declared(SGLangEngineConfig):
        for value in _literals(model.model_fields[name].annotation):
            assert ARG_VALUE_PATTERN.fullmatch(value), (model.__name__, name, value)
            seen += 1
    assert seen >= len(LORA_TARGET_MODULES) + len(CUDA_ATTENTION_BACKENDS)


FULL = SGLangPlatformConfig(cuda_attention_backend="flashinfer", lora_backend="triton", max_lora_rank=16,
                            lora_target_modules=("q_proj", "v_proj"), dtype="bfloat16", mem_fraction_static=0.4,
                            chunked_prefill_size=-1, cpu_max_total_tokens=4096)
CPU_FULL = SGLangPlatformConfig(chunked_prefill_size=-1, cpu_max_total_tokens=4096, dtype="float32")


@pytest.mark.parametrize("platform, config, fields", [
    (Platform.CUDA, FULL, {"cuda_attention_backend", "lora_backend", "max_lora_rank", "lora_target_modules", "dtype",
                           "mem_fraction_static", "chunked_prefill_size"}),
    (Platform.ROCM, FULL, {"max_lora_rank", "lora_target_modules", "dtype", "mem_fraction_static",
                           "chunked_prefill_size"}),
    (Platform.CPU, CPU_FULL, {"cpu_max_total_tokens", "chunked_prefill_size"}),
])
def test_the_plan_hands_every_config_value_to_the_builder(platform, config, fields):
    """The platform's own flags are constants; each value of the run's config is a SpecOption with the flag
    its field declares, so it reaches the command line through render_spec_options only."""
    plan = sglang_launch_plan(platform, config, {})
    declared = command_line_fields(SGLangPlatformConfig)
    assert {o.field.removeprefix("engine_config.server.") for o in plan.options} == fields
    for o in plan.options:
        name = o.field.removeprefix("engine_config.server.")
        assert (o.flag, o.value) == (declared[name], getattr(config, name))
    for flag in plan.flags:
        assert flag.startswith("--"), plan.flags


def test_a_plan_holds_no_element_a_value_could_occupy():
    with pytest.raises(ValueError, match="not one '--flag' or '--flag=value' element"):
        SGLangLaunchPlan(Platform.CPU, flags=("--dtype", "float32"))
    with pytest.raises(ValueError, match="not one"):
        SGLangLaunchPlan(Platform.CPU, flags=("--attention-backend=-x",))


def test_every_engine_option_that_declares_a_flag_reaches_the_builder():
    # SGLangEngineConfig's own options (outside `server`): all of them, through engine_run_options.
    # Every one set (an option left None passes nothing: the server's default).
    config = SGLangEngineConfig(tp_size=2, ep_size=2, moe_runner_backend="triton", moe_a2a_backend="deepep")
    options = engine_run_options(config)
    assert [(o.field, o.flag, o.value) for o in options] == [
        (f"engine_config.{name}", flag, getattr(config, name))
        for name, flag in command_line_fields(SGLangEngineConfig).items()
    ] and options
    assert [o.flag for o in engine_run_options(SGLangEngineConfig(tp_size=2))] == ["--tp-size"]


EXPLOIT = ("all", "--trust-remote-code", "--model-path", "/elsewhere")


def test_the_builder_refuses_at_launch_what_got_past_the_models():
    """A config that skipped validation (model_construct) still cannot put a flag on the command line."""
    bypassed = SGLangPlatformConfig.model_construct(max_lora_rank=8, lora_target_modules=EXPLOIT)
    plan = sglang_launch_plan(Platform.CUDA, bypassed, {})
    with pytest.raises(ValueError, match=r"engine_config\.server\.lora_target_modules\[1\]: '--trust-remote-code' "
                                         r"starts with '-'"):
        server_command("/py", plan, model_path="/m", host="127.0.0.1", port=1, weight_version="0", parent_pid=1)
    clean = sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(), {})
    for path in ("-m", "/a model", "/m\x00"):
        with pytest.raises(ValueError, match="^model_path: "):
            server_command("/py", clean, model_path=path, host="127.0.0.1", port=1, weight_version="0", parent_pid=1)


def test_the_engine_refuses_such_a_config_before_anything_runs(tmp_path):
    """SGLangEngine (what LoadModel builds) renders the run's options when it is built: a ValueError, which
    LoadModel answers with INVALID_ARGUMENT, before any server process could start."""
    from services.rollout.sglang.config import SGLangHostConfig
    from services.rollout.sglang.engine import SGLangEngine

    bypassed = SGLangEngineConfig.model_construct(
        **{**SGLangEngineConfig().model_dump(exclude={"server"}), "platform": "cuda",
           "server": SGLangPlatformConfig.model_construct(max_lora_rank=8, lora_target_modules=EXPLOIT)})
    with pytest.raises(ValueError, match=r"lora_target_modules\[1\]: '--trust-remote-code'"):
        SGLangEngine(bypassed, SGLangHostConfig(weights_dir=str(tmp_path), python=str(tmp_path / "no-python")))
    with pytest.raises(ValueError, match="^sglang_weights_dir: .*whitespace"):
        SGLangEngine(SGLangEngineConfig(platform="cpu"), SGLangHostConfig(weights_dir=str(tmp_path / "a b")))


# ------------------------------------------------------------------------ against the installed SGLang --

def _sglang_site() -> Path:
    python = Path(require_sglang_python())
    found = sorted(python.parent.parent.glob("lib/python3*/site-packages/sglang/srt"))
    require(bool(found), f"no sglang package in the virtualenv of {python}")
    return found[0]


def _assigned_list(path: Path, name: str) -> list[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise LookupError(f"{name} not assigned in {path}")


def test_the_enumerations_are_sglangs_own():
    """Read (not imported) from SGLang's sources: a value SGLang would refuse is refused at submit, and
    every module SGLang can target can be named."""
    srt = _sglang_site()
    modules = _assigned_list(srt / "utils" / "common.py", "SUPPORTED_LORA_TARGET_MODULES")
    assert set(LORA_TARGET_MODULES) == {*modules, "all"}
    assert set(CUDA_ATTENTION_BACKENDS) <= set(_assigned_list(srt / "arg_groups" / "choices.py",
                                                              "ATTENTION_BACKEND_CHOICES"))


PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
out = []
for argv in json.load(sys.stdin):
    ns = vars(parser.parse_args(argv))
    out.append({k: ns[k] for k in ("model_path", "host", "port", "tp_size", "dtype", "attention_backend",
                                   "lora_backend", "max_lora_rank", "lora_target_modules", "mem_fraction_static",
                                   "chunked_prefill_size", "max_total_tokens", "enable_lora", "weight_version",
                                   "ep_size", "moe_runner_backend", "moe_a2a_backend",
                                   "enable_return_routed_experts")})
print(json.dumps(out))
"""


@pytest.mark.slow
def test_sglangs_argparse_reads_each_command_line_as_the_config_says():
    """SGLang 0.5.23's own parser over the rendered command lines (GPU platforms included, which this host
    cannot launch): every `--flag=value` and the list after --lora-target-modules read as meant."""
    _sglang_site()
    model = "/models/-edge=--trust-remote-code"  # a path at the edge of the grammar: one value, not a flag
    cases = [(Platform.CUDA, FULL), (Platform.ROCM, FULL), (Platform.CPU, CPU_FULL),
             (Platform.CUDA, FULL.model_copy(update={"lora_target_modules": ("all",)}))]
    argvs = []
    for platform, config in cases:
        cmd = server_command("/py", sglang_launch_plan(platform, config, {}), model_path=model, host="127.0.0.1",
                             port=30001, weight_version="7", parent_pid=1,
                             run_options=engine_run_options(SGLangEngineConfig(tp_size=2)))
        argvs.append(cmd[4:])  # after python -c BOOTSTRAP <pid>: what sglang.launch_server parses
    # An MoE policy's options (tests/rollout/sglang/test_sglang_moe.py): SGLang's own flags, the switch included.
    moe = SGLangEngineConfig(tp_size=4, ep_size=2, moe_runner_backend="triton", moe_a2a_backend="deepep",
                             return_routed_experts=True)
    argvs.append(server_command("/py", sglang_launch_plan(Platform.CUDA, FULL, {}), model_path=model,
                                host="127.0.0.1", port=30001, weight_version="7", parent_pid=1,
                                run_options=engine_run_options(moe), switches=engine_switches(moe))[4:])
    proc = subprocess.run([default_python(), "-c", PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    common = {"model_path": model, "host": "127.0.0.1", "port": 30001, "tp_size": 2, "weight_version": "7",
              "chunked_prefill_size": -1}
    moe_keys = ("ep_size", "moe_runner_backend", "moe_a2a_backend", "enable_return_routed_experts")
    assert {k: got[-1][k] for k in moe_keys} == {"ep_size": 2, "moe_runner_backend": "triton",
                                                 "moe_a2a_backend": "deepep", "enable_return_routed_experts": True}
    got = [{k: v for k, v in g.items() if k not in moe_keys} for g in got[:-1]]
    cuda, rocm, cpu, cuda_all = got
    assert cuda == {**common, "dtype": "bfloat16", "attention_backend": "flashinfer", "lora_backend": "triton",
                    "max_lora_rank": 16, "lora_target_modules": ["q_proj", "v_proj"], "mem_fraction_static": 0.4,
                    "max_total_tokens": None, "enable_lora": True}
    assert rocm == {**cuda, "attention_backend": "triton"}
    assert cuda_all["lora_target_modules"] == ["all"]
    assert {k: cpu[k] for k in (*common, "dtype", "attention_backend", "max_total_tokens", "enable_lora")} == {
        **common, "dtype": "float32", "attention_backend": "torch_native", "max_total_tokens": 4096,
        "enable_lora": None}
