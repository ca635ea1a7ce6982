"""The GetWeights wire encoding written and read by hand (services/common/weights/chunk_frames.py) is protobuf's:
protobuf parses what encode_chunk writes as the chunk with its data, split_chunk reads protobuf's own
serialization (data in the middle of the fields) as the same chunk, and a malformed message is refused,
naming what is wrong."""
from __future__ import annotations

import pytest

from proto import lockstep_pb2 as pb
from services.common.weights.chunk_frames import ChunkFrameError, encode_chunk, split_chunk


def _header(**kw) -> pb.WeightChunk:
    base = dict(run_id="run-1", policy_version=7, name="model.layers.0.mlp.up_proj.weight", dtype="bfloat16",
                shape=[3, 5], offset=4096, tensor_nbytes=30, chunk_sha256="ab" * 32)
    return pb.WeightChunk(**{**base, **kw})


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16384, 4 * 1024 * 1024])
def test_protobuf_reads_the_encoding_as_the_chunk_with_its_data(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    header = _header(last=True, total_sha256="cd" * 32, total_chunks=9,
                     lora=pb.LoraAdapter(rank=4, alpha=8.0, target_modules=["q_proj"]))
    raw = encode_chunk(header, memoryview(data))
    expected = pb.WeightChunk()
    expected.CopyFrom(header)
    expected.data = data
    assert pb.WeightChunk.FromString(raw) == expected
    got, view = split_chunk(raw)
    assert bytes(view) == data and got == header and not got.data


def test_split_reads_protobufs_own_serialization_with_data_between_fields():
    full = _header(data=b"\x01\x02\x03" * 1000, last=True, total_chunks=3)
    got, view = split_chunk(full.SerializeToString())
    assert bytes(view) == full.data
    full.ClearField("data")
    assert got == full
    empty, no_data = split_chunk(_header().SerializeToString())
    assert empty == _header() and len(no_data) == 0


def test_encoding_refuses_a_header_that_carries_data():
    with pytest.raises(ValueError, match="header: carries data"):
        encode_chunk(_header(data=b"x"), b"y")


def test_malformed_messages_are_refused():
    raw = encode_chunk(_header(), b"payload")
    with pytest.raises(ChunkFrameError, match="data: appears more than once"):
        split_chunk(raw + b"\x42\x01z")  # a second data field (field 8, length-delimited)
    with pytest.raises(ChunkFrameError, match="runs past the end"):
        split_chunk(raw[:-3])
    with pytest.raises(ChunkFrameError, match="truncated varint"):
        split_chunk(raw + b"\x80")
    with pytest.raises(ChunkFrameError, match="wire type 3 is not used"):
        split_chunk(raw + b"\x0b")
    with pytest.raises(ChunkFrameError, match="varint longer than 10 bytes"):
        split_chunk(b"\x08" + b"\xff" * 11 + b"\x01")
    with pytest.raises(ChunkFrameError, match="not a WeightChunk"):
        split_chunk(b"\x0a\x02\xff\xfe" + raw)  # run_id (a string) that is not UTF-8
