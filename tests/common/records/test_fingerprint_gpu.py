"""The platform fingerprint on a real GPU (gpu marker: run on the device machine)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from services.common.records.fingerprint import ABSENT, PREFIX, probe_platform_details

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def test_gpu_fingerprint_names_the_device_its_arch_and_the_driver():
    d = {k[len(PREFIX):]: v for k, v in probe_platform_details("cuda:0").items()}
    assert d["device"] == "cuda:0" and d["device_name"] == torch.cuda.get_device_name(0)
    hip = getattr(torch.version, "hip", None)
    if hip:
        gcn = torch.cuda.get_device_properties(0).gcnArchName
        assert d["arch"] == gcn.split(":")[0] and d["arch"].startswith("gfx")
        assert d["rocm"] == hip and d["cuda"] == ABSENT
    else:
        major, minor = torch.cuda.get_device_capability(0)
        assert d["arch"] == f"sm_{major}{minor}"
        assert d["cuda"] == torch.version.cuda and d["rocm"] == ABSENT
        smi = shutil.which("nvidia-smi")
        if smi:  # the kernel module's version, as the driver tool reports it
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"],
                                 capture_output=True, text=True, timeout=60)
            assert d["driver"] == out.stdout.strip()
    assert d["driver"] != ABSENT
    assert d["torch"] == torch.__version__
