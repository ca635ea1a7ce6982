"""Whether received weights are finite: one pass per tensor (`all_finite`, `non_finite` for a whole set, read
back once), one pass per run of same-dtype tensors of a bucket (`bucket_non_finite`, an IPC handover), or
over raw bytes on any thread (`bytes_all_finite`, what the stream receiver runs on its worker threads while
chunks arrive)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Floating dtypes checked by one min/max reduction: torch.aminmax propagates NaN to both outputs when any
# value is NaN (documented), and an infinity is the max or the min itself. One pass and no intermediate
# tensor: several times faster than torch.isfinite(t).all(), which materializes a bool tensor.
_MINMAX_CHECKED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# IEEE 754 layouts as (unsigned integer of the same width, mask of the exponent bits). A value is NaN or
# an infinity exactly when every exponent bit is set, i.e. when its magnitude bits (sign cleared) are
# >= the exponent mask: the largest magnitude in a piece decides it.
_EXPONENT_BITS: dict[torch.dtype, tuple[type, int]] = {
    torch.float16: (np.uint16, 0x7C00),
    torch.bfloat16: (np.uint16, 0x7F80),
    torch.float32: (np.uint32, 0x7F80_0000),
    torch.float64: (np.uint64, 0x7FF0_0000_0000_0000),
}


class FiniteTensors(dict):
    """Tensors whose every floating value was found finite where they were received (read_weight_dir as it
    read them, an IPC handover over its buckets), so an engine applying them need not check them again."""


def _finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on t's device: whether every value of the non-empty floating tensor is finite."""
    if t.dtype in _MINMAX_CHECKED:
        low, high = torch.aminmax(t)
        return torch.isfinite(low) & torch.isfinite(high)
    return torch.isfinite(t).all()


def _read_back(flags: list[torch.Tensor]) -> list[bool]:
    """The flags' values, with one transfer per device (the host waits once, not once per flag)."""
    out = [True] * len(flags)
    by_device: dict[torch.device, list[int]] = {}
    for i, flag in enumerate(flags):
        by_device.setdefault(flag.device, []).append(i)
    for indices in by_device.values():
        for i, ok in zip(indices, torch.stack([flags[i] for i in indices]).tolist()):
            out[i] = ok
    return out


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite (no NaN, +inf or -inf)."""
    return t.numel() == 0 or bool(_finite_flag(t))


def non_finite(named: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity, `all_finite` on each, read back once: on
    a GPU the reductions are queued back to back and the host waits for the device one time, not once per
    tensor (a model's few hundred tensors each paid a round trip)."""
    checked = [(name, t) for name, t in named.items() if t.is_floating_point() and t.numel()]
    finite = _read_back([_finite_flag(t) for _, t in checked])
    return [name for (name, _), ok in zip(checked, finite) if not ok]


def bucket_non_finite(buffer: torch.Tensor, slots: Sequence[tuple[str, torch.dtype, int, int]]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity among `slots` (name, dtype, offset, nbytes;
    ascending offsets) of one flat uint8 buffer: one reduction over each run of consecutive slots of one
    floating dtype, bytes between them included, and one read-back for the buffer, instead of one per tensor.
    A run that is not all finite is looked at tensor by tensor, so the bytes between slots (alignment
    padding) can cost that second look but never name a tensor."""
    runs: list[tuple[torch.dtype, list[tuple[str, int, int]]]] = []
    joins = False  # whether the next slot of the last run's dtype may extend it (no other tensor between)
    for name, dtype, offset, nbytes in slots:
        if nbytes == 0:
            continue
        if not dtype.is_floating_point:
            joins = False
            continue
        if joins and runs[-1][0] == dtype:
            runs[-1][1].append((name, offset, nbytes))
        else:
            runs.append((dtype, [(name, offset, nbytes)]))
        joins = True
    finite = _read_back([_finite_flag(buffer[run[0][1]:run[-1][1] + run[-1][2]].view(dtype)) for dtype, run in runs])
    bad: list[str] = []
    for (dtype, run), ok in zip(runs, finite):
        if not ok:
            bad.extend(non_finite({name: buffer[offset:offset + nbytes].view(dtype) for name, offset, nbytes in run}))
    return bad


def checks_bytes(dtype: torch.dtype) -> bool:
    """Whether `bytes_all_finite` knows `dtype` (the floating dtypes of the wire)."""
    return dtype in _EXPONENT_BITS


def bytes_all_finite(data: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether the little-endian values of `dtype` in `data` (uint8, a whole number of values) are finite.

    Integer arithmetic in numpy: it releases the GIL and starts no threads of its own, so callers check
    pieces of a tensor on several threads without contending with torch's intra-op pool."""
    unsigned, exponent = _EXPONENT_BITS[dtype]
    width = np.dtype(unsigned).itemsize
    if data.dtype != np.uint8 or data.ndim != 1 or len(data) % width:
        raise ValueError(f"data: need flat uint8 of whole {dtype} values, got {data.dtype} of {len(data)} bytes")
    if not len(data):
        return True
    bits = data.view(unsigned)
    magnitude = np.bitwise_and(bits, unsigned(exponent | (exponent - 1)))  # sign bit cleared
    return int(magnitude.max()) < exponent
