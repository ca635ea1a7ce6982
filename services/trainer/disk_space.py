"""A write that failed because the disk is full: a state the run comes back from, not a trainer fault.

The writers report a full disk in three forms: Python's own writes as OSError ENOSPC (or EDQUOT, a quota
reached), safetensors' Rust writer as a SafetensorError whose message carries the OS error, and torch.save
as a RuntimeError whose context (when it writes to a Python file object) is that OSError. `space_errno`
recognises each; `writing` turns them into OutOfSpace naming the request field and the path, which the
server answers RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path

SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# How a Rust writer (safetensors) prints them: "No space left on device (os error 28)".
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class OutOfSpace(Exception):
    """A write refused for lack of space (or quota); nothing half-written is left behind as complete."""


def space_errno(exc: BaseException) -> int | None:
    """ENOSPC or EDQUOT when `exc`, or an exception it was raised from or while handling, is a full disk or
    quota; None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in SPACE_ERRNOS:
            return current.errno
        for code in map(int, _RUST_OS_ERROR.findall(str(current))):
            if code in SPACE_ERRNOS:
                return code
        current = current.__cause__ or current.__context__
    return None


@contextlib.contextmanager
def writing(field: str, path: str | Path) -> Iterator[None]:
    """Writes to `path` (named by request `field`) in the block: a full disk becomes OutOfSpace."""
    try:
        yield
    except Exception as exc:
        code = space_errno(exc)
        if code is None:
            raise
        raise OutOfSpace(f"{field}: {os.strerror(code)} (errno {code}) writing {path}; nothing was written "
                         "there; free space and retry") from exc
