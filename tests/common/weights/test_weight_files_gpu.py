"""Tensors on a GPU are written through the pinned staging ring: the file and the digest are those of the
same tensors on the CPU, including tensors a kernel is still producing when the write starts (the copies
run on the producing stream) and more buffers' worth than the ring holds."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.common.weights.files import (
    STAGING_BUFFER_BYTES,
    read_weight_dir,
    write_tensor_data,
    write_weight_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU"),
]

BLOCK = 4 * 1024 * 1024


def _cuda_weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(4096, 4096, device="cuda", generator=g)
    return [
        # Produced by kernels queued just before the write: nothing synchronizes in between.
        ("embed", (big * 3).to(torch.bfloat16)),  # 32 MiB
        ("mlp", torch.cat([big, big]).mul_(0.5).to(torch.bfloat16)),  # 64 MiB
        ("transposed", big[:1000, :700].t()),  # non-contiguous float32
        ("norm", torch.ones(1024, device="cuda", dtype=torch.bfloat16)),
        ("empty", torch.empty(0, 8, device="cuda")),
        ("step", torch.tensor(7, device="cuda", dtype=torch.int64)),
        ("host", torch.arange(11, dtype=torch.int32)),  # a CPU tensor among them
        ("tail", torch.randn(3 * BLOCK // 4 + 3, device="cuda", generator=g).to(torch.bfloat16)),
    ]


def test_gpu_tensors_write_the_file_and_digest_of_their_host_copies(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    weights = _cuda_weights()
    assert sum(t.numel() * t.element_size() for _, t in weights) > STAGING_BUFFER_BYTES
    on_gpu = write_weight_dir(tmp_path / "gpu", weights, 1, base_dir=base)
    host = [(n, t.cpu()) for n, t in weights]
    on_cpu = write_weight_dir(tmp_path / "cpu", host, 1, base_dir=base)
    assert on_gpu.total_sha256 == on_cpu.total_sha256 and on_gpu.nbytes == on_cpu.nbytes
    assert (on_gpu.directory / "model.safetensors").read_bytes() == (on_cpu.directory / "model.safetensors").read_bytes()
    tensors, _ = read_weight_dir(on_gpu.directory, policy_version=1, expected_sha256=on_cpu.total_sha256)
    assert all(torch.equal(tensors[n], t) for n, t in host)


def test_a_ring_smaller_than_the_tensors_is_reused_in_order(tmp_path):
    weights = _cuda_weights()
    outputs = []
    with ThreadPoolExecutor(4) as pool:
        for tensors in ([t for _, t in weights], [t.cpu() for _, t in weights]):
            path = tmp_path / f"out-{len(outputs)}.bin"
            with open(path, "wb", buffering=0) as f:
                digests = write_tensor_data(f, tensors, pool, staged=True, staging_bytes=BLOCK)
            outputs.append((path.read_bytes(), [d.result() for d in digests]))
    assert outputs[0] == outputs[1]
