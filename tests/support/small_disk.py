"""A real small filesystem to fill up: a tmpfs of a few MiB mounted on a test's directory (root only).

`small_tmpfs` mounts it (requiring, via tests.conftest.require, that mounting is possible: a skip on a
user's machine that cannot, a failure under LOCKSTEP_REQUIRE_ALL=1) and unmounts it however the test ends;
`fill` writes a ballast file until the filesystem refuses another byte (ENOSPC), so every write after it
meets a real full disk.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import require

BALLAST_CHUNK = 1 << 20


def _mount(directory: Path, size_bytes: int) -> str:
    """'' when mounted; why not otherwise."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(directory)],
                          capture_output=True, text=True)
    return "" if done.returncode == 0 else f"mount -t tmpfs failed: {done.stderr.strip() or done.returncode}"


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_bytes: int) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    why_not = _mount(directory, size_bytes)
    require(not why_not, f"a small tmpfs to fill up is needed ({why_not})")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "--lazy", str(directory)], check=False, capture_output=True)


def fill(directory: Path, name: str = "ballast") -> Path:
    """A file in `directory` that takes every free byte of its filesystem; its path."""
    ballast = directory / name
    chunk = b"\0" * BALLAST_CHUNK
    with open(ballast, "wb", buffering=0) as f:
        size = len(chunk)
        while size:
            try:
                f.write(chunk[:size])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                size //= 2  # the last pages: smaller writes until not one byte fits
    with open(ballast, "ab", buffering=0) as f:  # as full as a writer will find it
        try:
            f.write(b"\0")
            raise AssertionError(f"{directory} still takes a byte after the ballast")
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return ballast
