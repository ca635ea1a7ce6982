#!/usr/bin/env bash
# Build the SGLang CPU virtualenv that Lockstep's rollout service launches
# SGLang servers from (engine=sglang). Usage: setup_cpu_venv.sh [VENV_DIR]
#
# Idempotent and cached: a stamp file inside the venv records a hash of every
# input (this script, the pinned package list, the platform plugin's sources,
# the Python version); when it matches, the script exits at once. No root.
#
# What goes in, and why --no-deps everywhere:
#   - requirements-cpu.txt: the exact package set (torch 2.14.1, torchvision
#     0.29.1, transformers 5.19.0, tokenizers 0.23.2 and SGLang's small runtime
#     packages) under which sglang 0.5.23 serves on a plain CPU. Installing it
#     with the resolver on would pull sglang's GPU-only requirements
#     (sgl-kernel, flashinfer, cutlass), which neither install nor run here.
#   - sglang==0.5.23 itself, --no-deps for the same reason.
#   - cpu_platform/: Lockstep's out-of-tree SGLang platform (entry-point group
#     sglang.srt.platforms) that lets SGLang serve on a CPU without sgl-kernel.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-.venv-sglang}"
PYTHON="${PYTHON:-python3.11}"
SGLANG_VERSION="0.5.23"
# Build backend of the plugin (installed without build isolation so that the
# build needs no download beyond this pinned package).
SETUPTOOLS_VERSION="84.2.1"

if ! command -v "$PYTHON" >/dev/null; then
  echo "setup_cpu_venv: $PYTHON not found (the pinned torch 2.14.1 wheels are for CPython 3.11); set PYTHON=" >&2
  exit 1
fi

inputs_hash() {
  {
    cat "$HERE/setup_cpu_venv.sh" "$HERE/requirements-cpu.txt"
    find "$HERE/cpu_platform" -type f \( -name '*.py' -o -name '*.toml' \) -not -path '*/build/*' | LC_ALL=C sort | xargs cat
    "$PYTHON" -c 'import sys; print(sys.version)'
  } | sha256sum | cut -d' ' -f1
}

STAMP="$VENV/.lockstep-sglang-stamp"
WANT="$(inputs_hash)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/python" ]; then
  echo "setup_cpu_venv: $VENV is up to date"
  exit 0
fi

echo "setup_cpu_venv: building $VENV (sglang $SGLANG_VERSION, CPU; a few minutes, ~6 GB)"
rm -f "$STAMP"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip warns once per package about local index folders it does not have; that
# is noise, not a problem, so it is filtered (errors still fail the script).
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; return "${PIPESTATUS[0]}"; }

quiet "${PIP[@]}" install --quiet --no-deps -r "$HERE/requirements-cpu.txt"
quiet "${PIP[@]}" install --quiet --no-deps "sglang==$SGLANG_VERSION" "setuptools==$SETUPTOOLS_VERSION"
# Build the plugin from a copy so the source tree gets no build/ or egg-info.
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
cp -r "$HERE/cpu_platform/." "$BUILD/"
rm -rf "$BUILD/build" "$BUILD"/*.egg-info
quiet "${PIP[@]}" install --quiet --no-deps --no-build-isolation --force-reinstall "$BUILD"

# Fail here, not in the first test, when the set does not import or the
# plugin is not registered.
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points, version
import sglang, torch, transformers
eps = {ep.name for ep in entry_points(group="sglang.srt.platforms")}
assert "lockstep_cpu" in eps, f"lockstep_cpu platform plugin not registered (found {sorted(eps)})"
print(f"setup_cpu_venv: sglang {version('sglang')}, torch {torch.__version__}, transformers {transformers.__version__}; plugins {sorted(eps)}")
EOF
echo "$WANT" > "$STAMP"
