"""Build-time guard for the Lockstep images: installing Lockstep must not change the base image's torch.

The images are layered on the official SGLang images, whose torch, triton and
sglang were built together for one platform (ROCm 7 / gfx942, or CUDA). A
plain `pip install` of anything that names torch or triton can quietly pull
CUDA wheels from PyPI over the ROCm build (an MI300 image of a Qwen3-8B run needed constraints to keep pip
from pulling CUDA wheels over the base image's torch/sglang); the image would
still build, and fail - or worse, run on the wrong kernels - on the MI300.

    check_image.py snapshot BASE.json                  # before any pip install
    check_image.py constraints BASE.json --platform P [--overrides FILE]
    check_image.py verify BASE.json --platform P [--overrides FILE] [--import MOD ...] [--sglang-python PY]

`constraints` prints pip constraints: every base package pinned at its
version, CUDA runtime wheels refused on ROCm. The packages named in the
overrides file (requirements-overrides.txt: newer protobuf/grpcio for the
generated stubs) are left unpinned there and allowed to change in `verify`.

`verify` fails the build (exit 1, one line per problem) when a base package
changed version or vanished, torch is not the platform's build
(torch.version.hip on ROCm, torch.version.cuda on CUDA), an nvidia-*/cuda-*
wheel appeared on ROCm, a Lockstep module does not import, or the interpreter
the rollout launches SGLang with cannot import sglang over that same torch.

Runs under the base image's Python, so it keeps to the standard library and
Python 3.8 syntax; the pure functions take an `Env` so tests can feed them
any environment (tests/deploy/test_docker_images.py).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import os
import re
import sys
from typing import Dict, List, NamedTuple, Optional, Sequence

PLATFORMS = ("rocm", "cuda", "cpu")
# pyproject.toml's requires-python (a test keeps them equal).
MIN_PYTHON = (3, 11)

# Wheels that carry a CUDA user-space runtime. On ROCm none may be installed:
# they arrive only as dependencies of a CUDA torch/triton/jax wheel, which is
# exactly the replacement this guard exists to stop. Named explicitly in the
# constraints (pip then refuses any install that needs one); the verify step
# also catches names not on this list by prefix.
CUDA_WHEELS = (
    "nvidia-cublas-cu12", "nvidia-cuda-cupti-cu12", "nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12",
    "nvidia-cudnn-cu12", "nvidia-cufft-cu12", "nvidia-cufile-cu12", "nvidia-curand-cu12",
    "nvidia-cusolver-cu12", "nvidia-cusparse-cu12", "nvidia-cusparselt-cu12", "nvidia-nccl-cu12",
    "nvidia-nvjitlink-cu12", "nvidia-nvtx-cu12", "nvidia-nvshmem-cu12",
    "nvidia-cublas", "nvidia-cuda-cupti", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13",
    "nvidia-cufft", "nvidia-cufile", "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse",
    "nvidia-cusparselt-cu13", "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvtx", "nvidia-nvshmem-cu13",
    "cuda-toolkit", "cuda-bindings", "cuda-python",
)
CUDA_WHEEL_PREFIXES = ("nvidia-", "cuda-")
# PyPI's `triton` is the CUDA build. On ROCm the `triton` module comes from
# the base image (pytorch-triton-rocm or a ROCm triton build); a PyPI triton
# installed beside it would shadow that module.
ROCM_REFUSED_IF_ABSENT = ("triton",)
# Never overridable: replacing these is what the guard exists to stop.
NEVER_OVERRIDE = ("torch", "triton", "pytorch-triton-rocm", "sglang", "sgl-kernel", "torchvision", "torchaudio")


class Env(NamedTuple):
    python: tuple
    torch_version: Optional[str]
    hip: Optional[str]
    cuda: Optional[str]
    dists: Dict[str, str]  # normalized distribution name -> version

    def to_json(self) -> str:
        return json.dumps(self._asdict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Env":
        d = json.loads(text)
        d["python"] = tuple(d["python"])
        return cls(**d)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def current_env() -> Env:
    dists: Dict[str, str] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name and normalize(name) not in dists:  # first on sys.path wins, as for imports
            dists[normalize(name)] = dist.version
    try:
        import torch
        version, hip, cuda = torch.__version__, torch.version.hip, torch.version.cuda
    except ImportError:
        version = hip = cuda = None
    return Env(tuple(sys.version_info[:3]), version, hip, cuda, dists)


_PINNABLE = re.compile(r"^[0-9][0-9A-Za-z.+!_-]*$")


def read_overrides(text: str) -> List[str]:
    """Normalized names of the requirement lines in an overrides file; refuses the never-overridable ones."""
    names = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line)
        if not m:
            raise ValueError(f"overrides: cannot read a package name in {line!r}")
        name = normalize(m.group(0))
        if name in NEVER_OVERRIDE or name.startswith(CUDA_WHEEL_PREFIXES):
            raise ValueError(f"overrides: {name} must come from the base image, it cannot be overridden")
        names.append(name)
    return names


def constraints(base: Env, platform: str, overrides: Sequence[str] = ()) -> List[str]:
    """pip constraint lines: every base distribution at its exact version; CUDA wheels refused on ROCm."""
    lines = ["# Generated by deploy/docker/check_image.py from the base image; do not edit."]
    for name in sorted(base.dists):
        if name in overrides:
            continue
        version = base.dists[name]
        if _PINNABLE.match(version):  # skip odd legacy versions pip could not parse as a pin
            lines.append(f"{name}=={version}")
    if platform == "rocm":
        # `<0` admits no release: any install that needs one of these fails to resolve.
        refused = [n for n in CUDA_WHEELS if n not in base.dists]
        refused += [n for n in ROCM_REFUSED_IF_ABSENT if n not in base.dists]
        lines += [f"{n}<0" for n in sorted(set(refused))]
    return lines


def problems(base: Env, now: Env, platform: str, overrides: Sequence[str] = ()) -> List[str]:
    """Everything wrong with `now` as a Lockstep image for `platform`, built on `base`."""
    out: List[str] = []
    if tuple(now.python[:2]) < MIN_PYTHON:
        out.append(f"python {'.'.join(map(str, now.python))} is older than Lockstep's "
                   f"{'.'.join(map(str, MIN_PYTHON))}: pick a BASE_IMAGE with a newer Python")
    if now.torch_version is None:
        out.append("torch does not import")
    elif now.torch_version != base.torch_version:
        out.append(f"torch changed from {base.torch_version} to {now.torch_version}: a dependency replaced "
                   "the base image's torch (was something installed without -c constraints.txt?)")
    for name, version in sorted(base.dists.items()):
        if name not in now.dists:
            out.append(f"{name} {version} from the base image was removed")
        elif now.dists[name] != version and name not in overrides:
            out.append(f"{name} changed from {version} (base image) to {now.dists[name]}")
    if platform == "rocm":
        if not now.hip:
            out.append(f"torch.version.hip is {now.hip!r}: torch {now.torch_version} is not a ROCm build")
        if now.cuda:
            out.append(f"torch.version.cuda is {now.cuda!r} on a ROCm image")
        cuda_wheels = sorted(n for n in now.dists if n.startswith(CUDA_WHEEL_PREFIXES) and n not in base.dists)
        if cuda_wheels:
            out.append(f"CUDA wheels installed on a ROCm image: {', '.join(cuda_wheels)}")
    elif platform == "cuda":
        if not now.cuda:
            out.append(f"torch.version.cuda is {now.cuda!r}: torch {now.torch_version} is not a CUDA build")
        if now.hip:
            out.append(f"torch.version.hip is {now.hip!r} on a CUDA image")
    elif platform == "cpu":
        if now.hip or now.cuda:
            out.append(f"torch {now.torch_version} is a GPU build (hip={now.hip}, cuda={now.cuda})")
    return out


_SGLANG_PROBE = "import sglang, torch; print(torch.__version__)"


def sglang_python_problems(python: str, base: Env) -> List[str]:
    """The interpreter the rollout launches SGLang with must import sglang over the base image's torch."""
    import subprocess

    hint = ("set the SGLANG_PYTHON build arg to the base image's interpreter "
            "(docker run --rm $BASE_IMAGE python3 -c 'import sys; print(sys.executable)')")
    if not os.path.isfile(python):
        return [f"SGLang interpreter {python} does not exist: {hint}"]
    try:
        r = subprocess.run([python, "-c", _SGLANG_PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"SGLang interpreter {python} did not run: {exc}"]
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        return [f"SGLang interpreter {python} cannot import sglang and torch: {tail}; {hint}"]
    version = r.stdout.strip().splitlines()[-1]
    if version != base.torch_version:
        return [f"SGLang interpreter {python} runs torch {version}, the base image's is {base.torch_version}: "
                "rollout and trainer would not share kernels"]
    return []


def path_python_problems() -> List[str]:
    """`python3` on PATH (what docker-compose.yml runs) must be this interpreter's environment."""
    import shutil
    import subprocess

    found = shutil.which("python3")
    if found is None:
        return ["no python3 on PATH: docker-compose.yml runs `python3 -m services.<name>`"]
    r = subprocess.run([found, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True, timeout=60)
    prefix = r.stdout.strip()
    if r.returncode != 0 or os.path.realpath(prefix) != os.path.realpath(sys.prefix):
        return [f"python3 on PATH ({found}, prefix {prefix or '?'}) is not the interpreter Lockstep was installed "
                f"into ({sys.executable}, prefix {sys.prefix}): the services would run without their packages"]
    return []


def import_problems(modules: List[str]) -> List[str]:
    # The services run as `python -m services.<name>` from the source tree
    # (WORKDIR), so import the way they will: current directory first.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    out = []
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # any failure to import is a broken image
            out.append(f"import {mod} failed: {type(exc).__name__}: {exc}")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot", help="record the base image's packages and torch build")
    s.add_argument("out")
    s.add_argument("--expect-python", metavar="X.Y",
                   help="the Python the Dockerfile declares for its base image (BASE_PYTHON); fail if it is another")
    c = sub.add_parser("constraints", help="print pip constraints that keep the base image intact")
    c.add_argument("base")
    c.add_argument("--platform", choices=PLATFORMS, required=True)
    c.add_argument("--overrides", help="requirements file naming packages allowed to move")
    v = sub.add_parser("verify", help="fail if installing Lockstep changed the base image")
    v.add_argument("base")
    v.add_argument("--platform", choices=PLATFORMS, required=True)
    v.add_argument("--overrides", help="requirements file naming packages allowed to move")
    v.add_argument("--import", dest="imports", nargs="*", default=[], metavar="MODULE")
    v.add_argument("--sglang-python", help="interpreter the rollout launches SGLang with (must import sglang)")
    args = ap.parse_args(argv)

    if args.cmd == "snapshot":
        env = current_env()
        found_python = ".".join(map(str, env.python[:2]))
        if args.expect_python and args.expect_python != found_python:
            print(f"image check failed: the base image's Python is {found_python}, the Dockerfile declares "
                  f"BASE_PYTHON={args.expect_python}: update BASE_PYTHON with BASE_IMAGE", file=sys.stderr)
            return 1
        if tuple(env.python[:2]) < MIN_PYTHON:  # fail before a long pip install would
            print(f"image check failed: {problems(env, env, 'cpu')[0]}", file=sys.stderr)
            return 1
        with open(args.out, "w") as f:
            f.write(env.to_json())
        print(f"base image: python {'.'.join(map(str, env.python))}, torch {env.torch_version} "
              f"(hip {env.hip}, cuda {env.cuda}), {len(env.dists)} distributions")
        return 0
    with open(args.base) as f:
        base = Env.from_json(f.read())
    overrides: List[str] = []
    if args.overrides:
        with open(args.overrides) as f:
            overrides = read_overrides(f.read())
    if args.cmd == "constraints":
        print("\n".join(constraints(base, args.platform, overrides)))
        return 0
    found = problems(base, current_env(), args.platform, overrides) + import_problems(args.imports)
    if args.sglang_python:
        found += sglang_python_problems(args.sglang_python, base) + path_python_problems()
    for p in found:
        print(f"image check failed: {p}", file=sys.stderr)
    if not found:
        print(f"image check passed ({args.platform}): torch {base.torch_version} unchanged, "
              f"{len(base.dists) - len(overrides)} base packages unchanged, overridden: {', '.join(overrides) or 'none'}, "
              f"{len(args.imports)} modules import")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
