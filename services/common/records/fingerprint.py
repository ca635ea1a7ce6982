"""A run's platform fingerprint: what hardware and software produced its numbers.

Two runs of one recipe on two machines can only be compared when each says what it ran on. Every
service reports its own platform in its ServiceInfo details (`platform_details`, keys prefixed
`platform.`), and the coordinator folds the trainer's and each replica's details, with the run's spec,
into one document (`run_fingerprint`) stored with the run and shown by GET /v1/runs/{id}.

Both functions are pure: `probe_platform_details` reads the facts from this process (torch, the
driver files, installed packages) and hands them over, so the decisions are tested without a GPU.
"""
from __future__ import annotations

import functools
import importlib.metadata
import platform as host_platform
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "platform."
"""Details keys that carry the service's platform (the rest describe its engine or run)."""
PACKAGES = ("torch", "triton", "transformers", "sglang")
ABSENT = "absent"
"""A package that is not installed in the reporting process, or a driver/runtime the host lacks."""

NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")
AMDGPU_DRIVER_FILE = Path("/sys/module/amdgpu/version")
CPUINFO_FILE = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class DeviceFacts:
    """What a process sees of its device and runtime; every field as torch and the host report it."""

    device: str
    """The device the service computes on ('cpu', 'cuda:0')."""
    torch_cuda: str | None = None
    """torch.version.cuda (None on a CPU or ROCm build)."""
    torch_hip: str | None = None
    """torch.version.hip (None unless a ROCm build)."""
    device_name: str = ""
    """torch.cuda.get_device_name, or the CPU's model."""
    capability: tuple[int, int] | None = None
    """torch.cuda.get_device_capability on CUDA."""
    gcn_arch: str = ""
    """The device properties' gcnArchName on ROCm ('gfx942:sramecc+:xnack-')."""
    machine: str = ""
    """platform.machine() for a CPU device ('x86_64')."""
    driver: str = ""
    """The kernel driver's version, '' when none was found."""
    packages: Mapping[str, str] = field(default_factory=dict)
    """Version of each of PACKAGES, ABSENT when not installed."""
    deterministic_algorithms: bool = False
    """torch.are_deterministic_algorithms_enabled()."""
    cublas_workspace_config: str = ""
    """CUBLAS_WORKSPACE_CONFIG as the process sees it."""
    num_threads: int = 1


def platform_details(facts: DeviceFacts) -> dict[str, str]:
    """The `platform.*` details a service reports. Pure.

    The arch is what kernels are built for: sm_<major><minor> on CUDA, the gfx name without its feature
    flags on ROCm, the CPU's machine type otherwise.
    """
    on_gpu = not facts.device.startswith("cpu")
    if on_gpu and facts.torch_hip:
        arch = facts.gcn_arch.split(":", 1)[0] or "unknown"
    elif on_gpu and facts.capability is not None:
        arch = f"sm_{facts.capability[0]}{facts.capability[1]}"
    elif on_gpu:
        arch = "unknown"
    else:
        arch = facts.machine or "unknown"
    details = {
        "device": facts.device,
        "device_name": facts.device_name or "unknown",
        "arch": arch,
        "driver": facts.driver or ABSENT,
        "cuda": facts.torch_cuda or ABSENT,
        "rocm": facts.torch_hip or ABSENT,
        "deterministic_algorithms": str(facts.deterministic_algorithms).lower(),
        "cublas_workspace_config": facts.cublas_workspace_config or ABSENT,
        "num_threads": str(facts.num_threads),
    }
    for name in PACKAGES:
        details[name] = facts.packages.get(name, ABSENT)
    return {PREFIX + k: v for k, v in details.items()}


def parse_nvidia_driver(text: str) -> str:
    """The version in /proc/driver/nvidia/version ('NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15 ...')."""
    m = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+([0-9][0-9.]*)", text)
    return m.group(1) if m else ""


def parse_cpu_model(text: str) -> str:
    """The first 'model name' of /proc/cpuinfo ('AMD EPYC 9654 96-Core Processor'); '' when it has none."""
    m = re.search(r"^model name\s*:\s*(.+?)\s*$", text, re.M)
    return m.group(1) if m else ""


def _package(name: str) -> str:
    # A loaded module's own version first: it carries the build's local tag ('2.11.0+cu130'), which a
    # wheel's distribution metadata may leave out, and it is the code this process actually runs.
    module = sys.modules.get(name)
    if isinstance(getattr(module, "__version__", None), str):
        return module.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ABSENT


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@functools.lru_cache(maxsize=8)
def _static_facts(device: str) -> DeviceFacts:
    """The facts that cannot change while the process lives (device, driver, installed packages)."""
    import torch

    name, capability, gcn = "", None, ""
    on_gpu = not device.startswith("cpu") and torch.cuda.is_available()
    if on_gpu:
        index = torch.device(device).index or 0
        name = torch.cuda.get_device_name(index)
        capability = tuple(torch.cuda.get_device_capability(index))
        gcn = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "") or ""
    else:
        name = parse_cpu_model(_read(CPUINFO_FILE)) or host_platform.machine()
    hip = getattr(torch.version, "hip", None)
    if hip:
        driver = _read(AMDGPU_DRIVER_FILE).strip()
    else:
        driver = parse_nvidia_driver(_read(NVIDIA_DRIVER_FILE)) if on_gpu else ""
    return DeviceFacts(device=device, torch_cuda=torch.version.cuda, torch_hip=hip, device_name=name,
                       capability=capability, gcn_arch=gcn, machine=host_platform.machine(), driver=driver,
                       packages={p: _package(p) for p in PACKAGES})


def probe_platform_details(device: str) -> dict[str, str]:
    """`platform_details` of this process computing on `device` (determinism settings read now)."""
    import os

    import torch

    facts = _static_facts(device)
    return platform_details(DeviceFacts(
        **{**facts.__dict__, "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
           "num_threads": torch.get_num_threads()}))


def _platform(details: Mapping[str, str]) -> dict[str, str]:
    return {k[len(PREFIX):]: v for k, v in sorted(details.items()) if k.startswith(PREFIX)}


def _replica_attention(d: Mapping[str, str]) -> str:
    """A torch engine names its prefill and decode attention; other engines their one backend."""
    if d.get("prefill_attention") or d.get("decode_attention"):
        return f"prefill={d.get('prefill_attention', '')},decode={d.get('decode_attention', '')}"
    return d.get("attention_backend", d.get("attn_implementation", ""))


def run_fingerprint(spec: Mapping, trainer: Mapping[str, str], rollouts: Sequence[Mapping[str, str]]) -> dict:
    """One run's fingerprint from its spec (as stored) and the details the trainer and each live replica
    reported when the run was configured on them. Pure.

    `backends` are what the services chose for this run (the trainer's configured attention backend,
    'auto' when it selects by priority, and its resolved log-prob backend; each replica's engine,
    attention and log-prob backend); `numerics` the run's mode and the determinism settings each
    process runs under; `world_sizes` the trainer's data-parallel ranks and the replicas serving.
    """
    trainer_spec = spec.get("trainer", {}) if isinstance(spec.get("trainer"), Mapping) else {}
    rollout_spec = spec.get("rollout", {}) if isinstance(spec.get("rollout"), Mapping) else {}

    def replica(d: Mapping[str, str]) -> dict:
        return {
            "platform": _platform(d),
            "engine": d.get("engine", ""),
            "dtype": d.get("dtype", ""),
            "attention_backend": _replica_attention(d),
            "logprob_backend": d.get("logprob_backend", ""),
            "numerics": d.get("numerics", ""),
        }

    return {
        "trainer": {
            "platform": _platform(trainer),
            "dtype": trainer.get("dtype", ""),
            "attention_backend": trainer.get("attention_backend", ""),
            "logprob_backend": trainer.get("logprob_backend", ""),
            "batching": trainer.get("batching", ""),
            "numerics": trainer.get("numerics", ""),
        },
        "rollouts": [replica(d) for d in rollouts],
        "numerics": {
            "mode": spec.get("numerics", trainer_spec.get("numerics", "fast")),
            "trainer_deterministic_algorithms": trainer.get(PREFIX + "deterministic_algorithms", ""),
            "rollout_deterministic_algorithms": sorted({d.get(PREFIX + "deterministic_algorithms", "")
                                                       for d in rollouts}),
            "seed": spec.get("seed"),
        },
        "world_sizes": {
            "trainer_data_parallel": int(trainer.get("data_parallel", "1") or 1),
            "rollout_replicas": len(rollouts),
            "rollout_engine": rollout_spec.get("engine", ""),
        },
    }
