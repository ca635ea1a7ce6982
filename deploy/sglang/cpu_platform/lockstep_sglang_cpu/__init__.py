"""Entry point of Lockstep's out-of-tree SGLang CPU platform.

Why it exists: SGLang's in-tree CPU route (PlatformEnum.CPU) calls into
sgl-kernel's CPU ops, a source build for Xeon AMX that does not install on a
plain CPU machine. Registered as an *out-of-tree* platform (PlatformEnum.OOT),
SGLang takes its device-neutral torch paths instead, which is all a tiny model
in float32 needs.

This module must not import sglang or torch: SGLang loads every registered
entry point while it discovers platforms, and activate() decides cheaply
whether this one applies.
"""
from __future__ import annotations

import os

ACTIVATE_ENV = "LOCKSTEP_SGLANG_CPU_PLATFORM"
PLATFORM_QUALNAME = "lockstep_sglang_cpu.platform:LockstepCpuPlatform"


def activate() -> str | None:
    """Return the platform class's qualified name when asked for, else None.

    Opt-in by environment variable so that installing the plugin never changes
    what SGLang does on a machine with a GPU.
    """
    if os.environ.get(ACTIVATE_ENV, "") == "1":
        return PLATFORM_QUALNAME
    return None
