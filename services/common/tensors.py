"""Tensor <-> proto conversion with validation that names the offending field.

Every decode checks dtype, rank and byte size before touching the payload, so a
malformed message becomes a ValueError (mapped to INVALID_ARGUMENT by the
servers) instead of a crash or, worse, a silently reinterpreted buffer.
"""
from __future__ import annotations

import numpy as np
import torch

from proto import lockstep_pb2 as pb

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire") from None


def dtype_from_name(name: str, *, field: str = "dtype") -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"{field}: unknown dtype {name!r} (known: {sorted(_DTYPES)})") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian bytes of a tensor (bf16 reinterpreted as int16, numpy lacks bf16)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        arr = np.frombuffer(data, dtype=np.int16).copy()
        return torch.from_numpy(arr).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    arr = np.frombuffer(data, dtype=np_dtype).copy()
    return torch.from_numpy(arr).reshape(shape)


def to_proto(t: torch.Tensor) -> pb.Tensor:
    return pb.Tensor(dtype=dtype_name(t.dtype), shape=list(t.shape), data=tensor_bytes(t))


def from_proto(
    msg: pb.Tensor,
    *,
    field: str,
    dtype: torch.dtype | None = None,
    ndim: int | None = None,
) -> torch.Tensor:
    """Decode and validate. `field` names the message field in every error."""
    if not msg.dtype:
        raise ValueError(f"{field}: missing tensor")
    got = dtype_from_name(msg.dtype, field=f"{field}.dtype")
    if dtype is not None and got != dtype:
        raise ValueError(f"{field}: expected dtype {dtype_name(dtype)}, got {msg.dtype}")
    shape = list(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{field}: expected {ndim}-d tensor, got shape {shape}")
    if any(s < 0 for s in shape):
        raise ValueError(f"{field}: negative dimension in shape {shape}")
    numel = int(np.prod(shape)) if shape else 1
    itemsize = torch.empty(0, dtype=got).element_size()
    if len(msg.data) != numel * itemsize:
        raise ValueError(
            f"{field}: {len(msg.data)} bytes do not hold shape {shape} of {msg.dtype} "
            f"({numel * itemsize} bytes expected)"
        )
    return tensor_from_bytes(msg.data, got, shape)


def ids_to_proto(ids: list[int] | torch.Tensor) -> pb.Tensor:
    return to_proto(torch.as_tensor(ids, dtype=torch.int32).reshape(-1))


def logprobs_to_proto(values: list[float] | torch.Tensor) -> pb.Tensor:
    return to_proto(torch.as_tensor(values, dtype=torch.float32).reshape(-1))
