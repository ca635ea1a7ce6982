"""The proto Tensor wire format without torch: names, validation, and numpy encode/decode.

A `Tensor` message is a dtype name, a shape and the raw little-endian bytes
(bfloat16 as its 16 bits). Every decode checks dtype, rank and byte size
before touching the payload, so a malformed message becomes a ValueError
naming the field (INVALID_ARGUMENT at the servers) instead of a crash or a
silently reinterpreted buffer. services/common/tensors.py is the torch side of
the same format and runs the same checks (`check_tensor_proto`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from proto import lockstep_pb2 as pb

WIRE_DTYPES: dict[str, np.dtype | None] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": None,  # numpy has no bfloat16: decoded by widening its 16 bits into float32 (exact)
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
ITEM_SIZES: dict[str, int] = {name: (2 if dt is None else dt.itemsize) for name, dt in WIRE_DTYPES.items()}


def check_dtype_name(name: str, *, field: str = "dtype") -> str:
    if name not in WIRE_DTYPES:
        raise ValueError(f"{field}: unknown dtype {name!r} (known: {sorted(WIRE_DTYPES)})")
    return name


def check_tensor_proto(msg: pb.Tensor, *, field: str, dtype: str | None = None,
                       ndim: int | None = None) -> tuple[str, list[int]]:
    """(dtype name, shape) of a valid message; ValueError naming `field` and the reason otherwise."""
    if not msg.dtype:
        raise ValueError(f"{field}: missing tensor")
    got = check_dtype_name(msg.dtype, field=f"{field}.dtype")
    if dtype is not None and got != dtype:
        raise ValueError(f"{field}: expected dtype {dtype}, got {msg.dtype}")
    shape = list(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{field}: expected {ndim}-d tensor, got shape {shape}")
    if any(s < 0 for s in shape):
        raise ValueError(f"{field}: negative dimension in shape {shape}")
    numel = math.prod(shape)
    itemsize = ITEM_SIZES[got]
    if len(msg.data) != numel * itemsize:
        raise ValueError(
            f"{field}: {len(msg.data)} bytes do not hold shape {shape} of {msg.dtype} "
            f"({numel * itemsize} bytes expected)"
        )
    return got, shape


def array_from_proto(msg: pb.Tensor, *, field: str, dtype: str | None = None,
                     ndim: int | None = None) -> np.ndarray:
    """Decode and validate into a numpy array (bfloat16 comes back as the float32 of the same values)."""
    got, shape = check_tensor_proto(msg, field=field, dtype=dtype, ndim=ndim)
    np_dtype = WIRE_DTYPES[got]
    if np_dtype is None:
        bits = np.frombuffer(msg.data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(msg.data, dtype=np_dtype).copy().reshape(shape)


def array_to_proto(values: Sequence[float] | np.ndarray, dtype: str) -> pb.Tensor:
    """Encode `values` as `dtype` (not bfloat16: numpy cannot round to it)."""
    np_dtype = WIRE_DTYPES[check_dtype_name(dtype)]
    if np_dtype is None:
        raise ValueError(f"dtype: {dtype} cannot be encoded without torch")
    arr = np.asarray(values, dtype=np_dtype)
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


def ids_to_proto(ids: Sequence[int] | np.ndarray) -> pb.Tensor:
    """Token ids as a 1-d int32 tensor."""
    return array_to_proto(np.asarray(ids, dtype=np.int32).reshape(-1), "int32")


def logprobs_to_proto(values: Sequence[float] | np.ndarray) -> pb.Tensor:
    """Log-probs as a 1-d float32 tensor."""
    return array_to_proto(np.asarray(values, dtype=np.float32).reshape(-1), "float32")
