"""The safetensors file layout, encoded and parsed here so the weight bytes move without a library's copy.

Layout: 8 bytes little-endian N, then N bytes of JSON header padded with spaces (to a multiple of 8, as
safetensors pads), then the data. The header maps each tensor name to {"dtype", "shape", "data_offsets":
[start, end]} (offsets relative to the data's start) and may hold "__metadata__", a map of strings to
strings. The spans tile the data exactly: sorted by start they are contiguous from 0 to the data's end.
A file written here is read by safetensors.safe_open; a file parsed here is refused, naming the field,
unless it is of that exact layout (the reader trusts nothing of it before).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

HEADER_LENGTH_BYTES = 8
# safetensors refuses headers above 100 MB; a tensor order of a few thousand names is a few hundred kB.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"
TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
DTYPES_BY_NAME: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


class SafetensorsLayoutError(ValueError):
    """A header that is not of the safetensors layout, or tensors that cannot be written in it."""


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a file: where its bytes lie, relative to the start of the data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    data_start: int  # file offset of the data: 8 + the header's length
    tensors: dict[str, TensorSpan]
    metadata: dict[str, str]


def encode_header(named: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]
                  ) -> tuple[bytes, list[TensorSpan]]:
    """The bytes before the data (length and padded JSON) for tensors laid out in the given order."""
    entries: dict[str, object] = {METADATA_KEY: dict(metadata)}
    spans, offset = [], 0
    for name, dtype, shape in named:
        if name == METADATA_KEY:
            raise SafetensorsLayoutError(f"tensors: {METADATA_KEY!r} is the layout's metadata key, not a name")
        if dtype not in DTYPE_NAMES:
            raise SafetensorsLayoutError(f"tensors[{name!r}].dtype: {dtype} has no safetensors name")
        nbytes = math.prod(shape) * dtype.itemsize
        spans.append(TensorSpan(name, dtype, tuple(shape), offset, offset + nbytes))
        entries[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, spans


def _int_list(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in value)


def _span(name: str, entry: object) -> TensorSpan:
    where = f"header[{name!r}]"
    if not isinstance(entry, dict) or set(entry) != TENSOR_FIELDS:
        raise SafetensorsLayoutError(f"{where}: must be an object of exactly {sorted(TENSOR_FIELDS)}")
    dtype = DTYPES_BY_NAME.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise SafetensorsLayoutError(f"{where}.dtype: unknown dtype {entry['dtype']!r}")
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not _int_list(shape):
        raise SafetensorsLayoutError(f"{where}.shape: {shape!r} is not a list of non-negative integers")
    if not _int_list(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise SafetensorsLayoutError(f"{where}.data_offsets: {offsets!r} is not [start, end] with start <= end")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsLayoutError(f"{where}: shape {shape} of {entry['dtype']} is {nbytes} bytes, "
                                     f"its data_offsets span {offsets[1] - offsets[0]}")
    return TensorSpan(name, dtype, tuple(shape), offsets[0], offsets[1])


def parse_header(prefix: bytes, file_size: int) -> SafetensorsHeader:
    """The header of a file of `file_size` bytes whose first bytes are `prefix` (at least 8, and the whole
    header if it is shorter than the prefix; header_length tells how much to read)."""
    length = header_length(prefix, file_size)
    if len(prefix) < HEADER_LENGTH_BYTES + length:
        raise SafetensorsLayoutError(f"header: {length} bytes declared, {len(prefix) - HEADER_LENGTH_BYTES} given")
    raw = prefix[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + length]
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsLayoutError(f"header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsLayoutError("header: not a JSON object")
    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SafetensorsLayoutError(f"header.{METADATA_KEY}: must map strings to strings")
    tensors = {name: _span(name, entry) for name, entry in header.items()}
    data_bytes = file_size - HEADER_LENGTH_BYTES - length
    position = 0
    for span in sorted(tensors.values(), key=lambda s: (s.start, s.end)):
        if span.start != position:
            how = "overlaps the previous tensor" if span.start < position else "leaves a gap after the previous tensor"
            raise SafetensorsLayoutError(f"header[{span.name!r}].data_offsets: starts at {span.start}, "
                                         f"{how} (which ends at {position})")
        position = span.end
    if position != data_bytes:
        raise SafetensorsLayoutError(f"header: the tensors' data_offsets end at {position}, the file holds "
                                     f"{data_bytes} bytes of data")
    return SafetensorsHeader(HEADER_LENGTH_BYTES + length, tensors, metadata)


def header_length(prefix: bytes, file_size: int) -> int:
    """N, the JSON header's length, from the file's first 8 bytes; refused unless the header fits the file."""
    if len(prefix) < HEADER_LENGTH_BYTES or file_size < HEADER_LENGTH_BYTES:
        raise SafetensorsLayoutError(f"header: the file is {file_size} bytes, shorter than the 8-byte length")
    (length,) = struct.unpack("<Q", prefix[:HEADER_LENGTH_BYTES])
    if not 0 < length <= min(MAX_HEADER_BYTES, file_size - HEADER_LENGTH_BYTES):
        raise SafetensorsLayoutError(f"header: length {length} is not within the file's {file_size} bytes "
                                     f"(and at most {MAX_HEADER_BYTES})")
    return length
