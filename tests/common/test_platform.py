"""Platform detection and the SGLang flags/environment per platform, asserted exactly.

No AMD GPU is reachable, so ROCm behaviour is proven by the decisions made
given an environment (docs/DESIGN.md, "Portability without an AMD GPU").
"""
from __future__ import annotations

import importlib.util

import pytest

from contract.command_line import render_spec_options
from services.common.platform import (
    SGLANG_CPU_PLUGIN_ENV,
    SGLANG_CPU_PLUGIN_NAME,
    Platform,
    SGLangPlatformConfig,
    detect_platform,
    sglang_launch_plan,
)

ROCM_ENV = {"HIP_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin"}


def argv(plan) -> tuple[str, ...]:
    """The plan's part of the server's command line: its own flags, then the run's options as rendered."""
    return (*plan.flags, *render_spec_options(plan.options))


def test_rocm_flags_and_environment_exactly():
    plan = sglang_launch_plan(Platform.ROCM, SGLangPlatformConfig(), ROCM_ENV)
    assert argv(plan) == ("--attention-backend=triton", "--lora-backend=triton", "--enable-metrics", "--dtype=auto")
    assert plan.env_updates == {
        "CUDA_VISIBLE_DEVICES": "2,3",  # the operator's HIP choice wins over a stale CUDA one
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "NCCL_NVLS_ENABLE": "0",
        "SGLANG_ROPE_CACHE_FP32": "1",  # fp32 RoPE cache, as the trainer's: log-prob parity on MI300X
    }
    child = plan.child_env(ROCM_ENV)
    assert child["CUDA_VISIBLE_DEVICES"] == child["HIP_VISIBLE_DEVICES"] == "2,3"
    assert child["PATH"] == "/usr/bin"


def test_rocm_deterministic_bf16_and_no_hip_devices():
    cfg = SGLangPlatformConfig(deterministic=True, dtype="bfloat16", mem_fraction_static=0.4,
                               cuda_attention_backend="flashinfer")  # CUDA-only option: ignored on ROCm
    plan = sglang_launch_plan(Platform.ROCM, cfg, {})
    assert argv(plan) == (
        "--attention-backend=triton", "--lora-backend=triton",
        "--rl-on-policy-target=fsdp",  # SGLang's kernels follow the HF training forward
        "--enable-deterministic-inference", "--enable-metrics", "--dtype=bfloat16", "--mem-fraction-static=0.4",
    )
    # No HIP_VISIBLE_DEVICES: nothing to bridge, CUDA_VISIBLE_DEVICES left alone.
    assert plan.env_updates == {
        "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES": "1",
        "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
        "NCCL_NVLS_ENABLE": "0",
        "SGLANG_ROPE_CACHE_FP32": "1",
        "NCCL_ALGO": "allreduce:tree",  # one fixed all-reduce order under tensor parallelism
    }


def test_rocm_parity_settings_stay_on_rocm():
    # CUDA keeps its RoPE cache fp32 by itself, and its deterministic mode is SGLang's own; CPU runs
    # torch_native. Neither gets the ROCm parity settings.
    for platform, cfg in ((Platform.CUDA, SGLangPlatformConfig(deterministic=True)),
                          (Platform.CPU, SGLangPlatformConfig())):
        plan = sglang_launch_plan(platform, cfg, {})
        assert "SGLANG_ROPE_CACHE_FP32" not in plan.env_updates and "NCCL_ALGO" not in plan.env_updates
        assert not any(a.startswith("--rl-on-policy-target") for a in argv(plan))


def test_cuda_flags_exactly():
    plan = sglang_launch_plan(Platform.CUDA, SGLangPlatformConfig(), {"CUDA_VISIBLE_DEVICES": "1"})
    assert argv(plan) == ("--enable-metrics", "--attention-backend=fa3", "--dtype=auto")
    assert plan.env_updates == {}
    cfg = SGLangPlatformConfig(cuda_attention_backend="flashinfer", lora_backend="csgmv",
                               deterministic=True, dtype="bfloat16")
    assert argv(sglang_launch_plan(Platform.CUDA, cfg, {})) == (
        "--enable-deterministic-inference", "--enable-metrics",
        "--attention-backend=flashinfer", "--dtype=bfloat16", "--lora-backend=csgmv",
    )


def test_lora_serving_flags_per_platform():
    lora = SGLangPlatformConfig(max_lora_rank=64, dtype="bfloat16")
    assert argv(sglang_launch_plan(Platform.ROCM, lora, {})) == (
        "--attention-backend=triton", "--lora-backend=triton", "--enable-lora", "--enable-metrics",
        "--dtype=bfloat16", "--max-lora-rank=64", "--lora-target-modules=all",
    )
    cuda = SGLangPlatformConfig(max_lora_rank=16, lora_target_modules=("q_proj", "v_proj"), lora_backend="triton")
    # Two modules: argparse takes one value after '=', so the list follows the flag as elements of its own.
    assert argv(sglang_launch_plan(Platform.CUDA, cuda, {})) == (
        "--enable-lora", "--enable-metrics", "--attention-backend=fa3", "--dtype=auto", "--lora-backend=triton",
        "--max-lora-rank=16", "--lora-target-modules", "q_proj", "v_proj",
    )
    with pytest.raises(ValueError, match="lora_backend: 'csgmv' is CUDA-only; on ROCm SGLang's LoRA runs on triton"):
        sglang_launch_plan(Platform.ROCM, SGLangPlatformConfig(lora_backend="csgmv"), {})
    # SGLang's LoRA layers pin host memory and fail without a CUDA driver: refused before anything starts.
    with pytest.raises(ValueError, match="max_lora_rank: SGLang cannot serve LoRA adapters on CPU .*Found no NVIDIA"):
        sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(max_lora_rank=8), {})


def test_cpu_flags_and_environment_exactly():
    plan = sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(), {"HIP_VISIBLE_DEVICES": "0"})
    assert argv(plan) == (
        "--device=cpu", "--attention-backend=torch_native", "--disable-cuda-graph",
        "--dtype=float32", "--skip-server-warmup", "--sleep-on-idle", "--enable-metrics", "--max-total-tokens=8192",
    )
    assert plan.env_updates == {"LOCKSTEP_SGLANG_CPU_PLATFORM": "1", "SGLANG_PLATFORM": "lockstep_cpu"}
    # GPU-only options don't leak into the CPU command.
    cfg = SGLangPlatformConfig(mem_fraction_static=0.5, cpu_max_total_tokens=4096, dtype="float32")
    flags = argv(sglang_launch_plan(Platform.CPU, cfg, {}))
    assert not any(a.startswith("--mem-fraction-static") for a in flags)
    assert "--max-total-tokens=4096" in flags


def test_cpu_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match="deterministic"):
        sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(deterministic=True), {})
    with pytest.raises(ValueError, match="dtype"):
        sglang_launch_plan(Platform.CPU, SGLangPlatformConfig(dtype="bfloat16"), {})


def test_config_is_typed_and_closed():
    with pytest.raises(ValueError, match="attention_backend_typo"):
        SGLangPlatformConfig(attention_backend_typo="x")  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        SGLangPlatformConfig(dtype="fp8")  # type: ignore[arg-type]
    for name, f in SGLangPlatformConfig.model_fields.items():
        assert f.description, f"{name} has no description"


@pytest.mark.parametrize(
    ("env", "hip", "cuda", "want"),
    [
        ({}, None, False, Platform.CPU),
        ({}, None, True, Platform.CUDA),
        ({}, "6.2.41133", True, Platform.ROCM),
        ({}, "6.2.41133", False, Platform.CPU),  # a ROCm build with no visible device
        ({"LOCKSTEP_PLATFORM": "cpu"}, "6.2", True, Platform.CPU),  # operator override wins
        ({"LOCKSTEP_PLATFORM": " ROCm "}, None, False, Platform.ROCM),
    ],
)
def test_detect_platform(env, hip, cuda, want):
    assert detect_platform(env, torch_hip=hip, cuda_available=cuda) is want


def test_detect_platform_refuses_unknown_override():
    with pytest.raises(ValueError, match="LOCKSTEP_PLATFORM.*'tpu'"):
        detect_platform({"LOCKSTEP_PLATFORM": "tpu"}, torch_hip=None, cuda_available=False)


def test_plugin_constants_match_the_plugin_package(repo_root, monkeypatch):
    """The names the launcher sets are the ones the plugin registers and reads."""
    pkg = repo_root / "deploy" / "sglang" / "cpu_platform"
    assert f'{SGLANG_CPU_PLUGIN_NAME} = "lockstep_sglang_cpu:activate"' in (pkg / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.platforms"]' in (pkg / "pyproject.toml").read_text()
    spec = importlib.util.spec_from_file_location("lockstep_sglang_cpu", pkg / "lockstep_sglang_cpu" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # imports neither sglang nor torch
    assert mod.ACTIVATE_ENV == SGLANG_CPU_PLUGIN_ENV
    monkeypatch.delenv(SGLANG_CPU_PLUGIN_ENV, raising=False)
    assert mod.activate() is None  # installed but inactive: SGLang's own platform choice is untouched
    monkeypatch.setenv(SGLANG_CPU_PLUGIN_ENV, "1")
    assert mod.activate() == "lockstep_sglang_cpu.platform:LockstepCpuPlatform"


@pytest.mark.parametrize("platform", list(Platform))
def test_chunked_prefill_size_reaches_the_server_on_every_platform(platform):
    # miles' AMD Qwen3-4B LoRA launcher prefills in chunks of 4096 tokens beside a 0.4 memory fraction.
    flags = argv(sglang_launch_plan(platform, SGLangPlatformConfig(chunked_prefill_size=4096), {}))
    assert "--chunked-prefill-size=4096" in flags
    # -1 (no chunking) joined to its flag: never an element of its own that starts with '-'.
    off = argv(sglang_launch_plan(platform, SGLangPlatformConfig(chunked_prefill_size=-1), {}))
    assert "--chunked-prefill-size=-1" in off and "-1" not in off
    default = argv(sglang_launch_plan(platform, SGLangPlatformConfig(), {}))
    assert not any(a.startswith("--chunked-prefill-size") for a in default)


@pytest.mark.parametrize(("bad", "reason"), [
    (0, "cannot make progress"), (-2, "greater than or equal to -1"), (1 << 21, "less than or equal to"),
])
def test_chunked_prefill_size_refuses_sizes_sglang_cannot_use(bad, reason):
    with pytest.raises(ValueError, match=f"chunked_prefill_size\n.*{reason}"):
        SGLangPlatformConfig(chunked_prefill_size=bad)
