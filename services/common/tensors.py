"""torch Tensor <-> proto conversion with validation that names the offending field.

The wire format and its checks are the torch-free contract's
(contract/wire_tensors.py: dtype names, rank and byte-size validation before
the payload is touched); this module maps them to torch dtypes.
"""
from __future__ import annotations

import numpy as np
import torch

from contract.wire_tensors import check_dtype_name, check_tensor_proto
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
    return _DTYPES[check_dtype_name(name, field=field)]


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
    expected = None if dtype is None else dtype_name(dtype)
    got, shape = check_tensor_proto(msg, field=field, dtype=expected, ndim=ndim)
    return tensor_from_bytes(msg.data, _DTYPES[got], shape)


def ids_to_proto(ids: list[int] | torch.Tensor) -> pb.Tensor:
    return to_proto(torch.as_tensor(ids, dtype=torch.int32).reshape(-1))


def logprobs_to_proto(values: list[float] | torch.Tensor) -> pb.Tensor:
    return to_proto(torch.as_tensor(values, dtype=torch.float32).reshape(-1))
