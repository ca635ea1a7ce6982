"""The block SHA-256 kernel at the weights digest's 4 MiB blocks on a GPU, and the IPC bucket digest hashed on
the device equal to the same digest hashed on the host (gpu marker).

Run on a GPU machine: `python -m pytest -q -m gpu tests/kernels/digest/test_sha256_blocks_gpu.py`."""
from __future__ import annotations

import pytest
import torch

from kernels.digest.sha256_blocks import digests_of, launch_sha256_blocks, reference_sha256_blocks
from services.common.weights import ipc_transport as ipc
from services.common.weights.bucket_digest import BucketHasher
from services.common.weights.digest import DIGEST_BLOCK_BYTES, DIGEST_LEAF_BYTES, tensors_digest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")]


def test_four_mib_blocks_equal_hashlib():
    g = torch.Generator(device="cuda").manual_seed(0)
    data = torch.randint(0, 256, (5 * DIGEST_BLOCK_BYTES + 4096,), dtype=torch.uint8, device="cuda", generator=g)
    starts = [0, DIGEST_BLOCK_BYTES, 3 * DIGEST_BLOCK_BYTES + 256, 4 * DIGEST_BLOCK_BYTES + 4096]
    assert digests_of(launch_sha256_blocks(data, starts, DIGEST_BLOCK_BYTES)) == \
        reference_sha256_blocks(data, starts, DIGEST_BLOCK_BYTES)
    # The digest's own leaves, 256 KiB each.
    leaves = [s + i * DIGEST_LEAF_BYTES for s in starts for i in range(DIGEST_BLOCK_BYTES // DIGEST_LEAF_BYTES)]
    assert digests_of(launch_sha256_blocks(data, leaves, DIGEST_LEAF_BYTES)) == \
        reference_sha256_blocks(data, leaves, DIGEST_LEAF_BYTES)


def test_device_and_host_hashing_of_buckets_give_the_streams_digest():
    g = torch.Generator().manual_seed(1)
    named = [("embed", torch.randn(4096, 1536, generator=g).to(torch.bfloat16)),  # 3 whole blocks
             ("norm", torch.randn(1536, generator=g)),
             ("up", torch.randn(3000, 1000, generator=g).to(torch.bfloat16)),  # 1 whole block and a tail
             ("empty", torch.empty(0)),  # one empty leaf
             ("two_leaves", torch.randn(131072, generator=g))]  # a short block of whole leaves only
    layouts = ipc.layout_of(named, 8 << 20)
    buffers, start = [], 0
    for layout in layouts:
        buffer = torch.zeros(layout.nbytes, dtype=torch.uint8, device="cuda")
        ipc.pack(buffer, layout, [t.cuda() for _, t in named[start:start + len(layout.slots)]])
        start += len(layout.slots)
        buffers.append(buffer)
    torch.cuda.synchronize()
    expected = tensors_digest(named)[0]
    for on in ("host", "device"):
        hasher = BucketHasher(4, on=on)
        try:
            hasher.warm("cuda")
            assert hasher.digest(buffers, layouts) == expected, on
        finally:
            hasher.close()
