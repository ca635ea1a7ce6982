"""One digest per set of weights, whichever way it moved, and each byte hashed once per side.

The digest is recomputed here from its definition (sha256 over the sha256 of every tensor's 4 MiB blocks,
in order) and compared with what the stream's sender, the stream's receiver, the shared-path writer and its
reader compute, for chunkings that do and do not line up with the blocks. At the default chunk size the
sender and the receiver each feed every byte to sha256 once (counted through a wrapped hashlib.sha256).
"""
from __future__ import annotations

import pytest
import torch

from services.common.weights import stream as weight_stream
from services.common.weights.digest import DIGEST_BLOCK_BYTES, BlockDigests, tensors_digest
from services.common.weights.files import read_weight_dir, write_weight_dir
from services.common.weights.stream import (
    DEFAULT_CHUNK_BYTES,
    WeightStreamAssembler,
    WeightStreamError,
    iter_weight_chunks,
)
from tests.support.digest_reference import BLOCK, Sha256Counter, bytes_fed_once, digest_by_definition



def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("big", torch.randint(-2**15, 2**15, (BLOCK + 3 * 1024,), generator=g, dtype=torch.int16).view(torch.bfloat16)
         .reshape(-1, 1024)),  # two blocks, the second short
        ("empty", torch.empty(0, 3)),
        ("small", torch.randn(37, generator=g)),
        ("exact", torch.randint(0, 255, (BLOCK,), generator=g, dtype=torch.uint8)),  # exactly one block
    ]


def _receive(chunks) -> WeightStreamAssembler:
    asm = WeightStreamAssembler()
    for c in chunks:
        asm.add(c)
    return asm


def test_the_block_size_is_the_documented_one_and_the_default_chunk():
    assert DIGEST_BLOCK_BYTES == BLOCK == DEFAULT_CHUNK_BYTES


@pytest.mark.parametrize("chunk_bytes", [1000, BLOCK - 1, BLOCK, BLOCK + 5, 3 * BLOCK])
def test_stream_sender_receiver_and_shared_path_agree_with_the_definition(chunk_bytes, tmp_path):
    weights = _weights()
    expected = digest_by_definition(weights)
    chunks = list(iter_weight_chunks(weights, run_id="r", policy_version=1, chunk_bytes=chunk_bytes))
    assert chunks[-1].total_sha256 == expected
    asm = _receive(chunks)
    assert asm.total_sha256 == expected
    out = asm.finish()
    assert all(torch.equal(out[n].view(torch.uint8), t.view(torch.uint8)) for n, t in weights)

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    written = write_weight_dir(tmp_path / f"v1-{chunk_bytes}", weights, 1, base_dir=base)
    assert written.total_sha256 == expected
    _, read = read_weight_dir(written.directory, policy_version=1, expected_sha256=expected)
    assert read.total_sha256 == expected
    assert tensors_digest(weights, threads=1) == tensors_digest(weights, threads=3) == (expected, written.nbytes)


def test_a_stream_of_other_bytes_in_the_same_blocks_is_refused_at_the_end():
    weights = _weights()
    chunks = list(iter_weight_chunks(weights, run_id="r", policy_version=1))
    other = list(iter_weight_chunks([(n, t.clone() if n != "small" else t + 1) for n, t in weights],
                                    run_id="r", policy_version=1))
    chunks[-1].total_sha256 = other[-1].total_sha256
    with pytest.raises(WeightStreamError, match="total_sha256 mismatch"):
        _receive(chunks)


def test_pieces_cut_anyhow_give_the_block_digests_of_whole_blocks():
    data = bytes(range(256)) * (BLOCK // 128 + 3)  # two full blocks and a short one
    whole = BlockDigests()
    for o in range(0, len(data), BLOCK):
        whole.add("t", o, data[o:o + BLOCK], len(data))
    cut = BlockDigests()
    for o in range(0, len(data), 777_777):
        cut.add("t", o, data[o:o + 777_777], len(data))
    assert cut.digests == whole.digests and len(whole.digests) == 3
    assert cut.hexdigest() == whole.hexdigest()
    unfinished = BlockDigests()
    unfinished.add("t", 0, data[:10], len(data))
    with pytest.raises(ValueError, match="ended inside a digest block"):
        unfinished.hexdigest()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_at_the_default_chunk_size_each_side_hashes_each_byte_once(side, monkeypatch):
    weights = _weights()
    if side == "receiver":
        chunks = list(iter_weight_chunks(weights, run_id="r", policy_version=1))
    counted = Sha256Counter(monkeypatch)
    if side == "sender":
        chunks = list(iter_weight_chunks(weights, run_id="r", policy_version=1))
    else:
        _receive(chunks).finish()
    # Every byte once, plus the leaf digests into their blocks' and the block digests into the total.
    assert counted.fed == bytes_fed_once([t.numel() * t.element_size() for _, t in weights])


def test_a_corrupt_chunk_hashed_on_the_helper_thread_refuses_the_stream():
    # Chunks above PARALLEL_HASH_MIN_BYTES are verified on the helper thread: the mismatch is raised by a
    # later add() at the latest by the last chunk's, and the assembler is spent.
    weights = [("w", torch.arange(6 * 65536, dtype=torch.int32))]
    chunks = list(iter_weight_chunks(weights, run_id="r", policy_version=1, chunk_bytes=4 * 65536))
    assert len(chunks) == 6 and all(len(c.data) >= weight_stream.PARALLEL_HASH_MIN_BYTES for c in chunks)
    chunks[1].data = bytes(len(chunks[1].data))
    asm = WeightStreamAssembler()
    with pytest.raises(WeightStreamError, match=r"chunk 1 \('w'\): chunk_sha256 mismatch"):
        for c in chunks:
            asm.add(c)
    with pytest.raises(WeightStreamError, match="already refused: chunk 1"):
        asm.finish()
