"""A real sandbox pool for tests, or a skip (a failure under LOCKSTEP_REQUIRE_ALL=1) naming what the host lacks."""
from __future__ import annotations

import os
from pathlib import Path

from services.common.sandbox import SandboxLimits, SandboxPool, SandboxSettings, SandboxUnavailable
from tests.conftest import require


def sandbox_pool(workers: int = 2, **limits) -> SandboxPool:
    try:
        return SandboxPool(SandboxSettings(workers=workers), SandboxLimits(**limits))
    except SandboxUnavailable as exc:
        require(False, f"no sandbox on this host: {exc}")
        raise


def processes_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker` (a survivor of a sandbox would)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found
