"""The weight-stream receiver writes chunks into preallocated buffers and hands out views of them.

Checked: finish() copies nothing (its tensors are the receive buffers), a tensor whose declared byte size
does not match its dtype and shape is refused at its first chunk, an assembler that refused a chunk
accepts nothing more, and every tensor layout (non-contiguous, 0-d, empty, bool, bf16, chunks cut
mid-element, chunks big enough to hash on the helper thread) round-trips bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from services.common.weights import stream as weight_stream
from services.common.weights.stream import WeightStreamAssembler, WeightStreamError, iter_weight_chunks


def _assemble(chunks) -> WeightStreamAssembler:
    asm = WeightStreamAssembler()
    for c in chunks:
        asm.add(c)
    return asm


def test_finish_hands_out_the_receive_buffers_without_copying():
    w = {"a": torch.randn(300, 7), "b": torch.randn(5).to(torch.bfloat16)}
    asm = _assemble(iter_weight_chunks(w.items(), run_id="r", policy_version=1, chunk_bytes=512))
    first, second = asm.finish(), asm.finish()
    for name, t in w.items():
        assert torch.equal(first[name], t)
        assert first[name].data_ptr() == second[name].data_ptr()
        assert first[name].untyped_storage().nbytes() == t.numel() * t.element_size()


def test_a_tensor_whose_byte_size_disagrees_with_its_shape_is_refused_at_its_first_chunk():
    chunks = list(iter_weight_chunks([("w", torch.ones(4, 4))], run_id="r", policy_version=1))
    chunks[0].tensor_nbytes = 60
    with pytest.raises(WeightStreamError, match=r"tensor_nbytes=60 but shape \[4, 4\] of float32 holds 64 bytes"):
        WeightStreamAssembler().add(chunks[0])


def test_an_unknown_dtype_is_refused_naming_the_chunk():
    chunks = list(iter_weight_chunks([("w", torch.ones(4))], run_id="r", policy_version=1))
    chunks[0].dtype = "float8"
    with pytest.raises(WeightStreamError, match=r"chunk 0 \('w'\)\.dtype: unknown dtype 'float8'"):
        WeightStreamAssembler().add(chunks[0])


def test_after_a_refused_chunk_nothing_more_is_accepted():
    tensors = [("a", torch.ones(8)), ("b", torch.zeros(8))]
    chunks = list(iter_weight_chunks(tensors, run_id="r", policy_version=1))
    bad = type(chunks[0])()
    bad.CopyFrom(chunks[0])
    bad.chunk_sha256 = "0" * 64
    asm = WeightStreamAssembler()
    with pytest.raises(WeightStreamError, match="chunk_sha256 mismatch"):
        asm.add(bad)
    # The intact chunks that follow do not revive it.
    for c in chunks:
        with pytest.raises(WeightStreamError, match="already refused: chunk 0 .* chunk_sha256 mismatch"):
            asm.add(c)
    with pytest.raises(WeightStreamError, match="already refused"):
        asm.finish()


@pytest.mark.parametrize("chunk_bytes", [3, 1000, 1 << 20])
def test_every_layout_round_trips_bit_for_bit(chunk_bytes, monkeypatch):
    # A low threshold sends the larger chunks through the helper-thread hash as well.
    monkeypatch.setattr(weight_stream, "PARALLEL_HASH_MIN_BYTES", 512)
    g = torch.Generator().manual_seed(0)
    w = {
        "transposed": torch.randn(33, 17, generator=g).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "mask": torch.rand(19, generator=g) > 0.5,
        "half": torch.randn(9, 3, generator=g).to(torch.bfloat16),
        "ids": torch.randint(-5, 5, (7,), generator=g, dtype=torch.int64),
    }
    chunks = list(iter_weight_chunks(w.items(), run_id="r", policy_version=2, chunk_bytes=chunk_bytes))
    out = _assemble(chunks).finish()
    assert set(out) == set(w)
    for name, t in w.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t), name


def _encoded(chunks) -> list[bytes]:
    return [c.SerializeToString() for c in chunks]


@pytest.mark.parametrize("workers", [1, 3])
def test_raw_chunks_assemble_like_parsed_ones_on_any_number_of_workers(workers):
    w = {"a": torch.randn(70_000).to(torch.bfloat16), "b": torch.arange(5000, dtype=torch.int64),
         "c": torch.randn(3, 0), "d": torch.tensor(2.5)}
    chunks = list(iter_weight_chunks(w.items(), run_id="r", policy_version=4, chunk_bytes=65_539))
    parsed = _assemble(chunks)
    raw = WeightStreamAssembler(workers=workers)
    for c in _encoded(chunks):
        raw.add_raw(c)
    assert raw.total_sha256 == parsed.total_sha256 and raw.policy_version == 4
    for name, t in raw.finish().items():
        assert torch.equal(t, w[name]) and t.dtype == w[name].dtype


@pytest.mark.parametrize("chunk_bytes", [7, 65_537, 1 << 22])
def test_the_finite_check_finds_a_bad_value_wherever_chunks_cut_the_tensor(chunk_bytes):
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            # 7-byte chunks cut the tensor every few elements: a thousand of them already make hundreds of cuts.
            n = 1_001 if chunk_bytes == 7 else 40_001
            t = torch.randn(n).to(dtype)
            t[n - 1 if chunk_bytes == 7 else 20_000] = bad
            chunks = _encoded(iter_weight_chunks([("ok", torch.ones(9)), ("w", t)], run_id="r", policy_version=1,
                                                 chunk_bytes=chunk_bytes))
            asm = WeightStreamAssembler(workers=2, check_finite=True)
            with pytest.raises(WeightStreamError, match=r"^w: non-finite values$"):
                for c in chunks:
                    asm.add_raw(c)
            assert not asm.finite_checked
            with pytest.raises(WeightStreamError, match="already refused"):
                asm.finish()
            unchecked = WeightStreamAssembler(workers=2)  # the engine's own check still has to find it
            for c in chunks:
                unchecked.add_raw(c)
            assert not unchecked.finite_checked and not bool(torch.isfinite(unchecked.finish()["w"]).all())


def test_finite_streams_report_their_check_and_use_the_callers_memory():
    w = {"a": torch.randn(100_000), "n": torch.arange(10)}
    handed: list[torch.Tensor] = []

    def allocate(nbytes: int) -> torch.Tensor:
        handed.append(torch.empty(nbytes, dtype=torch.uint8))
        return handed[-1]

    asm = WeightStreamAssembler(check_finite=True, allocate=allocate)
    for c in _encoded(iter_weight_chunks(w.items(), run_id="r", policy_version=1)):
        asm.add_raw(c)
    got = asm.finish()
    assert asm.finite_checked
    assert [t.data_ptr() for t in got.values()] == [b.data_ptr() for b in handed]
    assert all(torch.equal(got[n], w[n]) for n in w)


def test_a_malformed_raw_chunk_is_refused_naming_it():
    asm = WeightStreamAssembler()
    with pytest.raises(WeightStreamError, match=r"chunk 0: truncated varint"):
        asm.add_raw(b"\x80")
    with pytest.raises(WeightStreamError, match="already refused"):
        asm.add_raw(_encoded(iter_weight_chunks([("w", torch.ones(2))], run_id="r", policy_version=1))[0])
