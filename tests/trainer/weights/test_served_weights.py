"""The trainer's served version (services/trainer/weights/served_weights.py) sends what the reference chunker
sends: for every chunk size, every dtype and layout, its chunks parse as iter_weight_chunks' chunks (same
fields, same bytes, same digests), a second reader gets the same bytes, the snapshot does not move when
the live tensors do, each byte is hashed once however many replicas read the version, and a held
version's buffer is never taken over by a later cut (one that was refuses new holders)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from proto import lockstep_pb2 as pb
from services.common.weights.stream import LoraAdapterMeta, WeightStreamAssembler, iter_weight_chunks
from services.trainer.weights.served_weights import VersionRetired, WeightVersion
from tests.support.digest_reference import Sha256Counter, bytes_fed_once


@pytest.fixture(scope="module")
def pools():
    with ThreadPoolExecutor(3) as hash_pool, ThreadPoolExecutor(2) as encode_pool:
        yield hash_pool, encode_pool


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(1000, 33, generator=g).to(torch.bfloat16)),
        ("ragged", torch.randn(4097, generator=g)),
        ("transposed", torch.randn(6, 5, generator=g).t()),
        ("ids", torch.arange(17, dtype=torch.int64)),
        ("mask", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(3.25, dtype=torch.float64)),
        ("empty", torch.empty(0, 4)),
    ]


def _version(tensors, pools, **kw) -> WeightVersion:
    hash_pool, encode_pool = pools
    return WeightVersion(tensors, run_id="run", policy_version=3, hash_pool=hash_pool, encode_pool=encode_pool,
                         **{"chunk_bytes": 4 << 20, "lora": None, **kw})


def _read(version: WeightVersion, ahead: int = 4) -> list[bytes]:
    reader, out = version.reader(ahead), []
    while (f := reader.next_chunk()) is not None:
        out.append(f.result())
    return out


@pytest.mark.parametrize("chunk_bytes", [7, 1000, 4096, 4 << 20])
def test_chunks_are_the_reference_chunkers(pools, chunk_bytes):
    tensors = _tensors()
    lora = LoraAdapterMeta(rank=2, alpha=4.0, target_modules=("q_proj",)) if chunk_bytes == 1000 else None
    version = _version(tensors, pools, chunk_bytes=chunk_bytes, lora=lora)
    sent = [pb.WeightChunk.FromString(raw) for raw in _read(version)]
    expected = list(iter_weight_chunks(tensors, run_id="run", policy_version=3, chunk_bytes=chunk_bytes, lora=lora))
    assert sent == expected  # every field, payload included
    assert version.total_sha256() == expected[-1].total_sha256 and len(version) == len(expected)
    assert version.nbytes == sum(t.numel() * t.element_size() for _, t in tensors)
    asm = WeightStreamAssembler(workers=2)
    for raw in _read(version, ahead=1):  # a second reader, one chunk ahead
        asm.add_raw(raw)
    got = asm.finish()
    assert all(torch.equal(got[n], t) for n, t in tensors)


def test_the_snapshot_does_not_follow_the_live_tensors(pools):
    live = torch.zeros(100_000)
    version = _version([("w", live)], pools)
    live.fill_(1.0)
    asm = WeightStreamAssembler()
    for raw in _read(version):
        asm.add_raw(raw)
    assert torch.equal(asm.finish()["w"], torch.zeros(100_000))


def test_nothing_to_send_or_a_bad_chunk_size_is_refused(pools):
    with pytest.raises(ValueError, match="no tensors to send"):
        _version([], pools)
    with pytest.raises(ValueError, match="chunk_bytes: must be positive"):
        _version(_tensors(), pools, chunk_bytes=0)


def test_the_buffer_serves_the_tensors_and_is_taken_over_only_when_no_one_holds_it(pools):
    tensors = _tensors()
    first = _version(tensors, pools)
    written = first.tensors()  # what WriteWeights writes: views of the host copy
    assert [n for n, _ in written] == [n for n, _ in tensors]
    assert all(t.dtype == o.dtype and t.shape == o.shape and torch.equal(t, o) for (_, t), (_, o) in zip(written, tensors))
    with first.held():
        second = _version([(n, t + 1 if t.is_floating_point() else t) for n, t in tensors], pools, reuse=first)
        assert second.buffer.data_ptr() != first.buffer.data_ptr()  # held: a buffer of its own
        assert all(torch.equal(t, o) for (_, t), (_, o) in zip(first.tensors(), tensors))  # unchanged
    reader = second.reader()  # an open stream holds it as well
    third = _version(tensors, pools, reuse=second)
    assert third.buffer.data_ptr() != second.buffer.data_ptr()
    reader.close()
    owned = first.buffer.data_ptr()
    fourth = _version(tensors, pools, reuse=first)  # no holder left: its memory is written over
    assert fourth.buffer.data_ptr() == owned
    with pytest.raises(VersionRetired, match="policy_version 3: its host copy was reused"):
        first.acquire()
    with pytest.raises(VersionRetired):
        first.reader()
    assert [pb.WeightChunk.FromString(raw).chunk_sha256 for raw in _read(fourth)] == \
        [pb.WeightChunk.FromString(raw).chunk_sha256 for raw in _read(third)]


@pytest.mark.gpu
def test_gpu_tensors_are_cut_through_pinned_memory(pools):
    tensors = [(n, t.cuda()) for n, t in _tensors()]
    version = _version(tensors, pools, chunk_bytes=1 << 16)
    assert version.buffer.is_pinned()
    sent = [pb.WeightChunk.FromString(raw) for raw in _read(version)]
    cpu = [(n, t.cpu()) for n, t in tensors]
    assert sent == list(iter_weight_chunks(cpu, run_id="run", policy_version=3, chunk_bytes=1 << 16))


def test_at_the_default_chunk_size_each_byte_is_hashed_once_however_many_read(pools, monkeypatch):
    counted = Sha256Counter(monkeypatch)
    tensors = [("big", torch.randn(3 << 20)), ("small", torch.randn(10))]
    version = _version(tensors, pools)
    for _ in range(2):
        _read(version)
    # Every byte once, each leaf digest into its block's, each block digest into the total.
    assert counted.fed == bytes_fed_once([t.numel() * t.element_size() for _, t in tensors])


def test_a_version_only_written_to_a_directory_is_not_hashed_here(pools, monkeypatch):
    counted = Sha256Counter(monkeypatch)
    version = _version([("big", torch.randn(3 << 20))], pools)
    with version.held():
        version.tensors()  # what WriteWeights writes (and hashes as it writes)
    assert counted.fed == 0
