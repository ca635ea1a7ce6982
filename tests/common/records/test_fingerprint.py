"""The platform fingerprint's decisions, from given facts (no GPU needed), and this host's probe."""
from __future__ import annotations

import platform

import torch

from services.common.records.fingerprint import (
    ABSENT,
    PACKAGES,
    PREFIX,
    DeviceFacts,
    parse_cpu_model,
    parse_nvidia_driver,
    platform_details,
    probe_platform_details,
    run_fingerprint,
)


def test_cuda_arch_is_sm_major_minor_and_versions_are_carried():
    d = platform_details(DeviceFacts(device="cuda:0", torch_cuda="12.8", device_name="NVIDIA H200",
                                     capability=(9, 0), driver="570.86.15",
                                     packages={"torch": "2.9.1", "triton": "3.5.1"}))
    assert d[PREFIX + "arch"] == "sm_90"
    assert d[PREFIX + "device_name"] == "NVIDIA H200"
    assert d[PREFIX + "cuda"] == "12.8" and d[PREFIX + "rocm"] == ABSENT
    assert d[PREFIX + "driver"] == "570.86.15"
    assert d[PREFIX + "torch"] == "2.9.1" and d[PREFIX + "triton"] == "3.5.1"
    assert d[PREFIX + "sglang"] == ABSENT and d[PREFIX + "transformers"] == ABSENT
    assert all(k.startswith(PREFIX) for k in d)


def test_rocm_arch_is_the_gfx_name_without_feature_flags():
    d = platform_details(DeviceFacts(device="cuda:0", torch_hip="6.4.43482", capability=(9, 4),
                                     gcn_arch="gfx942:sramecc+:xnack-", device_name="AMD Instinct MI300X"))
    assert d[PREFIX + "arch"] == "gfx942"
    assert d[PREFIX + "rocm"] == "6.4.43482" and d[PREFIX + "cuda"] == ABSENT


def test_a_cpu_device_reports_the_machine_even_on_a_gpu_build():
    d = platform_details(DeviceFacts(device="cpu", torch_cuda="12.8", capability=(9, 0), machine="x86_64"))
    assert d[PREFIX + "arch"] == "x86_64"


def test_nvidia_driver_version_is_read_from_the_proc_file():
    text = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Thu Jan 23 2025\nGCC version:  gcc version 12.3.0\n")
    assert parse_nvidia_driver(text) == "570.86.15"
    assert parse_nvidia_driver("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar") == "550.54.15"
    assert parse_nvidia_driver("") == ""


def test_cpu_model_is_read_from_cpuinfo():
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\nflags\t: fpu\n"
    assert parse_cpu_model(text) == "AMD EPYC 9654 96-Core Processor"
    assert parse_cpu_model("processor\t: 0\n") == ""


def test_this_host_probe_names_its_cpu_torch_and_determinism():
    d = probe_platform_details("cpu")
    assert d[PREFIX + "device"] == "cpu"
    assert d[PREFIX + "arch"] == platform.machine()
    assert d[PREFIX + "torch"] == torch.__version__
    assert d[PREFIX + "deterministic_algorithms"] == str(torch.are_deterministic_algorithms_enabled()).lower()
    assert set(PACKAGES) <= {k[len(PREFIX):] for k in d}


def test_run_fingerprint_folds_services_and_spec():
    trainer = {**platform_details(DeviceFacts(device="cpu", machine="x86_64", deterministic_algorithms=True)),
               "dtype": "float32", "attention_backend": "auto", "logprob_backend": "reference", "batching": "packed",
               "numerics": "fast", "data_parallel": "2", "torch": "ignored: not a platform key"}
    replica = {**platform_details(DeviceFacts(device="cpu", machine="x86_64")), "engine": "torch",
               "prefill_attention": "sdpa", "decode_attention": "paged", "logprob_backend": "auto",
               "numerics": "fast", "dtype": "float32"}
    spec = {"numerics": "fast", "seed": 3, "rollout": {"engine": "torch"}, "trainer": {}}
    f = run_fingerprint(spec, trainer, [replica, replica])
    assert f["trainer"]["platform"]["arch"] == "x86_64" and "torch" in f["trainer"]["platform"]
    assert f["trainer"]["attention_backend"] == "auto" and f["trainer"]["logprob_backend"] == "reference"
    assert f["rollouts"][0]["attention_backend"] == "prefill=sdpa,decode=paged"
    assert f["world_sizes"] == {"trainer_data_parallel": 2, "rollout_replicas": 2, "rollout_engine": "torch"}
    assert f["numerics"]["mode"] == "fast" and f["numerics"]["seed"] == 3
    assert f["numerics"]["trainer_deterministic_algorithms"] == "true"
    assert f["numerics"]["rollout_deterministic_algorithms"] == ["false"]
