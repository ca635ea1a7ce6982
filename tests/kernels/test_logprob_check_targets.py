"""`python -m kernels.check_targets`: Triton AOT for gfx942 and sm_90, native source through hipcc (and nvcc)."""
from __future__ import annotations

import json
import os
import shutil

from tests.conftest import require
from tests.kernels.target_compile import STARTED, CheckTargetsProcess


def test_every_kernel_compiles_for_mi300_and_hopper(request, repo_root):
    try:
        import triton  # noqa: F401
    except ImportError:
        require(False, "triton is not installed")
    require(shutil.which("hipcc") is not None, "hipcc is not installed (apt-get install hipcc)")
    check = request.session.stash.get(STARTED, None)  # started after collection (target_compile.py)
    if check is None:
        check = CheckTargetsProcess.start(repo_root, jobs=os.cpu_count() or 1)
        request.addfinalizer(check.stop)
    # A guard against a hung compiler, not a speed bound: a loaded 2-core host needs ~7 min.
    returncode, stdout, stderr = check.result(timeout_s=1800)
    assert stdout, stderr[-4000:]
    report = json.loads(stdout)
    failed = [r for r in report["results"] if r.get("ok") is False]
    assert returncode == 0 and report["ok"], json.dumps(failed, indent=1)[-4000:]
    triton_targets = {(r["kernel"], r["target"]) for r in report["results"] if r["kind"] == "triton"}
    for kernel in ("logprob_partials_kernel", "logprob_merge_kernel", "logprob_backward_kernel",
                   "bi_matmul_kernel", "bi_rms_norm_kernel", "bi_attention_kernel", "_gumbel_argmax_kernel",
                   "bi_grouped_matmul_kernel", "sha256_blocks_kernel", "bi_decode_split_kernel",
                   "bi_decode_combine_kernel", "bi_matmul_combine_kernel"):
        assert {(kernel, "hip:gfx942:w64"), (kernel, "cuda:90:w32")} <= triton_targets
    assert all(r["binary"] == ("hsaco" if r["target"].startswith("hip") else "cubin") and r["bytes"] > 0
               for r in report["results"] if r["kind"] == "triton")
    native = {(r["compiler"], r["target"]): r for r in report["results"] if r["kind"] == "native"}
    assert native[("hipcc", "gfx90a")]["ok"] and native[("hipcc", "gfx940")]["ok"]
    assert ("nvcc", "sm_90") in native  # compiled, or reported absent
