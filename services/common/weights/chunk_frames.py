"""A WeightChunk on the wire without copying its payload more than the wire itself does.

Protobuf's Python runtime copies a bytes field on every assignment, serialization, parse and read,
about four copies of every weight byte per side. The GetWeights stream is therefore encoded and decoded
here, by the protobuf wire format itself: a message is a sequence of fields in any order, so the
serialization of a WeightChunk without `data`, followed by the `data` field (tag, length, bytes), is the
encoding of the chunk with its data, and any protobuf parser reads it as such. `encode_chunk` writes the
payload once, straight from the sender's buffer; `split_chunk` finds the payload in a received message
and hands it out as a view, and parses the rest (a few hundred bytes) with protobuf, which checks it.
"""
from __future__ import annotations

from proto import lockstep_pb2 as pb

_DATA_FIELD = pb.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
_LENGTH_DELIMITED = 2
_DATA_TAG = bytes([(_DATA_FIELD << 3) | _LENGTH_DELIMITED])
assert _DATA_FIELD < 16, "the tag of `data` is one byte"


class ChunkFrameError(ValueError):
    """A received message that is not a well-formed WeightChunk."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def encode_chunk(header: pb.WeightChunk, data: memoryview | bytes) -> bytes:
    """The encoding of `header` with `data` as its data field; `header` must not carry data itself."""
    if header.data:
        raise ValueError("header: carries data; pass the payload as `data`")
    return b"".join((header.SerializeToString(), _DATA_TAG, _varint(len(data)), data))


def _read_varint(raw: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(raw):
            raise ChunkFrameError("truncated varint")
        if shift > 63:
            raise ChunkFrameError("varint longer than 10 bytes")
        byte = raw[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def split_chunk(raw: bytes) -> tuple[pb.WeightChunk, memoryview]:
    """(every field but data, parsed by protobuf; data as a view of `raw`). A message with no data field
    has empty data; one that holds data more than once, or is malformed, is refused."""
    view = memoryview(raw)
    pos, span = 0, None
    while pos < len(view):
        start = pos
        tag, pos = _read_varint(view, pos)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _read_varint(view, pos)
            if field == _DATA_FIELD:
                if span is not None:
                    raise ChunkFrameError("data: appears more than once in one chunk")
                span = (start, pos, pos + length)
            pos += length
        else:
            raise ChunkFrameError(f"field {field}: wire type {wire_type} is not used by WeightChunk")
        if pos > len(view):
            raise ChunkFrameError(f"field {field}: runs past the end of the message")
    if span is None:
        header_bytes, data = raw, view[0:0]
    else:
        field_start, data_start, data_end = span
        header_bytes = b"".join((view[:field_start], view[data_end:]))
        data = view[data_start:data_end]
    try:
        header = pb.WeightChunk.FromString(header_bytes)
    except Exception as exc:  # protobuf's DecodeError, or a message its parser refuses
        raise ChunkFrameError(f"not a WeightChunk: {exc}") from None
    if header.data:  # only reachable if the parser saw a data field this walk did not
        raise ChunkFrameError("data: appears more than once in one chunk")
    return header, data
