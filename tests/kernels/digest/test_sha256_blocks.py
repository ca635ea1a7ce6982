"""The block SHA-256 kernel against hashlib, in Triton's interpreter without a GPU (the block size is a
compile-time constant: small blocks here, the digest's 4 MiB in tests/kernels/digest/test_sha256_blocks_gpu.py)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from kernels.digest.sha256_blocks import LANES, digests_of, launch_sha256_blocks, reference_sha256_blocks

pytestmark = pytest.mark.slow  # Triton's interpreter runs each compression round by round in numpy


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_every_lane_equals_hashlib_across_programs_and_unaligned_blocks():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (64 * 50 + 3,), dtype=torch.uint8, generator=g)
    # More lanes than one program holds, blocks that overlap and start at any multiple of 4 bytes.
    starts = [4 * i for i in range(LANES + 9)]
    got = digests_of(launch_sha256_blocks(data.to(_device()), starts, 128))
    assert got == reference_sha256_blocks(data, starts, 128)
    assert got[0] == hashlib.sha256(data[:128].numpy().tobytes()).digest()
    assert len(set(got)) == len(starts)


def test_a_known_vector_and_a_changed_bit():
    block = torch.tensor(list(b"abcd" * 16), dtype=torch.uint8)  # one 64-byte chunk
    digest = digests_of(launch_sha256_blocks(block.to(_device()), [0], 64))[0]
    assert digest.hex() == hashlib.sha256(b"abcd" * 16).hexdigest()
    flipped = block.clone()
    flipped[63] ^= 1
    assert digests_of(launch_sha256_blocks(flipped.to(_device()), [0], 64))[0] != digest


def test_blocks_that_are_not_whole_chunks_or_leave_the_buffer_are_refused():
    data = torch.zeros(256, dtype=torch.uint8)
    for starts, size in (([0], 100), ([2], 64), ([224], 64), ([0], 0)):
        with pytest.raises(ValueError):
            launch_sha256_blocks(data, starts, size)
    assert launch_sha256_blocks(data, [], 64).shape == (0, 8)

