"""The image guard (deploy/docker/check_image.py) and the Dockerfiles that run it.

No Docker here, so the guard is tested by its decisions given an environment
(docs/DESIGN.md: ROCm behaviour is tested that way), plus one real run against this
virtualenv; the Dockerfiles are read to check the guard runs where it must.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

DOCKER = REPO_ROOT / "deploy" / "docker"
CHECK = DOCKER / "check_image.py"
DOCKERFILES = {"rocm": DOCKER / "Dockerfile.rocm", "cuda": DOCKER / "Dockerfile.cuda"}


def _load():
    spec = importlib.util.spec_from_file_location("check_image", CHECK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["check_image"] = mod  # NamedTuple pickling/introspection wants the module registered
    spec.loader.exec_module(mod)
    return mod


ci = _load()

ROCM_BASE = ci.Env(
    python=(3, 12, 3), torch_version="2.9.1+rocm7.2.0", hip="7.2.0", cuda=None,
    dists={"torch": "2.9.1+rocm7.2.0", "pytorch-triton-rocm": "3.5.1", "sglang": "0.5.14",
           "transformers": "4.57.1", "protobuf": "6.31.1", "grpcio": "1.75.0"},
)
CUDA_BASE = ci.Env(
    python=(3, 12, 3), torch_version="2.9.1+cu129", hip=None, cuda="12.9",
    dists={"torch": "2.9.1+cu129", "triton": "3.5.1", "sglang": "0.5.14", "nvidia-nccl-cu12": "2.27.5"},
)


def after(base, *, torch=None, hip="same", cuda="same", add=(), change=()):
    """`base` after an install that added/changed distributions (and maybe replaced torch)."""
    dists = dict(base.dists)
    dists.update(dict(add))
    dists.update(dict(change))
    if torch:
        dists["torch"] = torch
    return base._replace(torch_version=torch or base.torch_version, dists=dists,
                         hip=base.hip if hip == "same" else hip, cuda=base.cuda if cuda == "same" else cuda)


def test_a_clean_rocm_install_passes():
    now = after(ROCM_BASE, add={"fastapi": "0.115.0", "redis": "5.2.1", "lockstep": "0.1.0"},
                change={"protobuf": "7.35.1", "grpcio": "1.85.1"})
    assert ci.problems(ROCM_BASE, now, "rocm", overrides=["protobuf", "grpcio"]) == []


def test_cuda_torch_over_rocm_is_refused_with_reasons():
    # A real MI300 image failure: a dependency pulled PyPI's CUDA torch and its runtime wheels.
    now = after(ROCM_BASE, torch="2.9.1+cu128", hip=None, cuda="12.8",
                add={"nvidia-cublas-cu12": "12.8.4.1", "nvidia-nccl-cu12": "2.27.3", "triton": "3.5.1"})
    found = "\n".join(ci.problems(ROCM_BASE, now, "rocm"))
    assert "torch changed from 2.9.1+rocm7.2.0 to 2.9.1+cu128" in found
    assert "torch.version.hip is None" in found
    assert "torch.version.cuda is '12.8'" in found
    assert "nvidia-cublas-cu12, nvidia-nccl-cu12" in found


def test_any_new_cuda_wheel_on_rocm_is_refused_even_if_unlisted():
    now = after(ROCM_BASE, add={"nvidia-some-future-lib-cu14": "1.0"})
    assert ci.problems(ROCM_BASE, now, "rocm") == ["CUDA wheels installed on a ROCm image: nvidia-some-future-lib-cu14"]


def test_base_package_moved_or_removed_is_refused_unless_overridden():
    moved = after(ROCM_BASE, change={"transformers": "5.0.0", "protobuf": "7.35.1"})
    found = ci.problems(ROCM_BASE, moved, "rocm", overrides=["protobuf"])
    assert found == ["transformers changed from 4.57.1 (base image) to 5.0.0"]
    gone = ROCM_BASE._replace(dists={k: v for k, v in ROCM_BASE.dists.items() if k != "sglang"})
    assert ci.problems(ROCM_BASE, gone, "rocm") == ["sglang 0.5.14 from the base image was removed"]


def test_platform_mismatch_and_old_python():
    assert any("not a CUDA build" in p for p in ci.problems(ROCM_BASE, ROCM_BASE, "cuda"))
    assert ci.problems(CUDA_BASE, CUDA_BASE, "cuda") == []  # nvidia wheels belong on a CUDA image
    old = ROCM_BASE._replace(python=(3, 10, 12))
    assert any("older than Lockstep's 3.11" in p for p in ci.problems(old, old, "rocm"))


def test_constraints_pin_the_base_and_refuse_cuda_wheels_on_rocm():
    lines = ci.constraints(ROCM_BASE, "rocm", overrides=["protobuf", "grpcio"])
    assert "torch==2.9.1+rocm7.2.0" in lines and "sglang==0.5.14" in lines
    assert not any(line.startswith(("protobuf", "grpcio")) for line in lines)
    assert "nvidia-nccl-cu12<0" in lines and "nvidia-cublas<0" in lines
    # The ROCm base has no `triton` distribution (pytorch-triton-rocm provides the module): PyPI's would shadow it.
    assert "triton<0" in lines
    cuda = ci.constraints(CUDA_BASE, "cuda")
    assert "nvidia-nccl-cu12==2.27.5" in cuda and not any(line.endswith("<0") for line in cuda)


def test_overrides_file_cannot_release_torch():
    assert ci.read_overrides("protobuf>=7\n# c\n\ngrpcio>=1.85  # x\n") == ["protobuf", "grpcio"]
    for bad in ("torch>=2.10", "triton", "nvidia-nccl-cu12", "SGLang==0.5.20"):
        with pytest.raises(ValueError, match="cannot be overridden"):
            ci.read_overrides(bad)


def test_overrides_minimums_match_the_generated_stubs():
    # The stubs refuse to import under an older runtime than the one that generated them.
    pb = (REPO_ROOT / "proto" / "lockstep_pb2.py").read_text()
    grpc_stub = (REPO_ROOT / "proto" / "lockstep_pb2_grpc.py").read_text()
    protobuf_gen = re.search(r"# Protobuf Python Version: ([0-9.]+)", pb).group(1)
    grpc_gen = re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_stub).group(1)
    text = (DOCKER / "requirements-overrides.txt").read_text()
    assert f"protobuf>={protobuf_gen}" in text and f"grpcio>={grpc_gen}" in text


def test_min_python_matches_pyproject():
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    wanted = re.search(r'requires-python\s*=\s*">=(\d+)\.(\d+)"', pyproject).groups()
    assert ci.MIN_PYTHON == tuple(map(int, wanted))


def test_cli_against_this_virtualenv(tmp_path):
    # Real distributions and a real torch: the CPU build here is refused as a ROCm image.
    base = tmp_path / "base.json"
    run = lambda *a: subprocess.run([sys.executable, str(CHECK), *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=REPO_ROOT, timeout=120)
    base.write_text(ci.current_env().to_json())  # what `snapshot` writes (in-process: one torch import less)
    assert ci.Env.from_json(base.read_text()) == ci.current_env()
    rocm = run("verify", str(base), "--platform", "rocm", "--import", "services.trainer.config", "no_such_module")
    assert rocm.returncode == 1
    import torch
    assert rocm.stderr.strip().splitlines() == [
        f"image check failed: torch.version.hip is None: torch {torch.__version__} is not a ROCm build",
        "image check failed: import no_such_module failed: ModuleNotFoundError: No module named 'no_such_module'"]
    constraints = run("constraints", str(base), "--platform", "rocm",
                      "--overrides", str(DOCKER / "requirements-overrides.txt"))
    assert constraints.returncode == 0
    assert f"torch=={torch.__version__}" in constraints.stdout.splitlines()


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_dockerfile_runs_the_guard_around_every_install(platform):
    text = DOCKERFILES[platform].read_text()
    runs = [r for r in re.split(r"\n(?=RUN )", text) if r.startswith("RUN ")]
    snapshot = next(i for i, r in enumerate(runs) if "check_image.py snapshot" in r)
    verify = max(i for i, r in enumerate(runs) if "check_image.py verify" in r)
    installs = [i for i, r in enumerate(runs) if "pip install" in r]
    assert installs and snapshot < min(installs) and verify > max(installs)
    for i in installs:
        for cmd in re.findall(r"pip install[^;\n]*", runs[i]):
            assert "-c /opt/lockstep-build/constraints.txt" in cmd, cmd
    assert f"--platform {platform}" in runs[snapshot] and f"--platform {platform}" in runs[verify]
    assert "--sglang-python" in runs[verify] and "--overrides" in runs[verify]
    base = re.search(r"ARG BASE_IMAGE=(\S+)", text).group(1)
    assert base.startswith(("lmsysorg/sglang:", "lmsysorg/sglang-rocm:")) and \
        (("rocm" in base) == (platform == "rocm")), base
    if platform == "rocm":
        assert "FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE" in text


# The Python of SGLang's ROCm image flavours, as SGLang's own rocm.Dockerfile builds them: the
# ROCm 7.0 and 7.2.0 flavours on Python 3.10, the ROCm 7.2.4 one on Python 3.12.
SGLANG_ROCM_FLAVOUR_PYTHON = {"rocm700": "3.10", "rocm720": "3.10", "rocm724": "3.12"}


def _arg(text: str, name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", text, flags=re.M).group(1)


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_base_image_python_is_one_the_package_accepts(platform):
    from packaging.specifiers import SpecifierSet

    text = DOCKERFILES[platform].read_text()
    declared = _arg(text, "BASE_PYTHON")
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    requires = SpecifierSet(re.search(r'^requires-python\s*=\s*"([^"]+)"', pyproject, flags=re.M).group(1))
    assert declared in requires, f"{platform}: BASE_PYTHON={declared} but the package requires Python {requires}"
    if platform == "rocm":
        base = _arg(text, "BASE_IMAGE")
        flavour = re.search(r"-(rocm\d+)-", base).group(1)
        assert SGLANG_ROCM_FLAVOUR_PYTHON[flavour] == declared, f"{base} ships Python {SGLANG_ROCM_FLAVOUR_PYTHON[flavour]}"
    # The build checks the declaration against the image itself, before anything is installed.
    runs = [r for r in re.split(r"\n(?=RUN )", text) if r.startswith("RUN ")]
    snapshot = next(r for r in runs if "check_image.py snapshot" in r)
    assert '--expect-python "$BASE_PYTHON"' in snapshot
    assert re.search(r"^FROM \$\{BASE_IMAGE\}\nARG BASE_PYTHON$", text, flags=re.M), "BASE_PYTHON not in scope after FROM"


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_images_install_the_math_extra_and_check_it_imports(platform):
    text = DOCKERFILES[platform].read_text()
    install = next(r for r in re.split(r"\n(?=RUN )", text) if "requirements-overrides.txt ." in r
                   or 'requirements-overrides.txt ".[' in r)
    assert '".[math]"' in install, install  # task: math scores with math-verify
    verify = next(r for r in re.split(r"\n(?=RUN )", text) if "check_image.py verify" in r)
    assert "math_verify" in verify


def test_snapshot_refuses_a_base_whose_python_is_not_the_declared_one(tmp_path):
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    run = lambda *a: subprocess.run([sys.executable, str(CHECK), "snapshot", str(tmp_path / "base.json"), *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    wrong = run("--expect-python", "3.10")
    assert wrong.returncode == 1 and not (tmp_path / "base.json").exists()
    assert f"the base image's Python is {here}, the Dockerfile declares BASE_PYTHON=3.10" in wrong.stderr
    right = run("--expect-python", here)
    assert right.returncode == 0, right.stderr
    assert ci.Env.from_json((tmp_path / "base.json").read_text()).python[:2] == sys.version_info[:2]


@pytest.mark.parametrize("platform", sorted(DOCKERFILES))
def test_dockerfile_copies_exist_and_are_not_ignored(platform):
    text = DOCKERFILES[platform].read_text()
    ignored = [line.strip() for line in (DOCKER / f"Dockerfile.{platform}.dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for line in re.findall(r"^COPY (.+)$", text, flags=re.M):
        for src in line.split()[:-1]:
            assert (REPO_ROOT / src).exists(), src
            assert not any(src == pat or src.startswith(pat.rstrip("/") + "/") for pat in ignored), src
