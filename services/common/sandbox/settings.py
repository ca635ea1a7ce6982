"""What one sandboxed execution may use (`SandboxLimits`) and how the operator sets up the pool (`SandboxSettings`).

Limits are per execution and may come from a run spec (the code task's options), inside the bounds below;
everything that decides what runs and what is visible (the interpreter, the read-only paths, the uid, the
pool size) is the operator's, read from the coordinator's environment (`LOCKSTEP_SANDBOX_*`), never from a
run spec.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

NOBODY = 65534
"""The uid and gid the sandboxed program has inside its user namespace (and outside it when the pool runs as root
and drops to `uid`)."""


def _reachable_by_others(path: str) -> bool:
    """Every directory above `path` lets other users through (o+x): a dropped uid can exec it."""
    parent = Path(path).parent
    return all(os.stat(d).st_mode & 0o001 for d in (parent, *parent.parents))


def default_python() -> str:
    own = os.path.realpath(sys._base_executable)
    return own if _reachable_by_others(own) else os.path.realpath("/usr/bin/python3")


def default_read_only(python: str) -> tuple[str, ...]:
    """/usr (the C library and the loader) and the installation prefix of `python` (its standard library)."""
    prefix = str(Path(python).parent.parent)
    return ("/usr",) if Path(prefix).is_relative_to("/usr") else ("/usr", prefix)


class SandboxLimits(BaseModel):
    """Kernel limits of one execution (setrlimit inside the sandbox; wall time and output bytes by the parent)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    wall_s: float = Field(10.0, gt=0.0, le=300.0, description="Wall-clock bound of one execution; past it the whole "
                          "sandbox is killed and the outcome is 'timeout'.")
    cpu_s: int = Field(10, ge=1, le=300, description="CPU seconds (RLIMIT_CPU): SIGXCPU at this, SIGKILL one second "
                       "later; either is the outcome 'timeout'.")
    memory_mb: int = Field(512, ge=64, le=16384, description="Address space in MiB (RLIMIT_AS): an allocation past "
                           "it fails (MemoryError) instead of growing.")
    processes: int = Field(16, ge=2, le=1024, description="Processes and threads of the sandbox's user (RLIMIT_NPROC, "
                           "counted in the sandbox's own user namespace): a fork bomb stops at this many.")
    open_files: int = Field(64, ge=16, le=4096, description="Open file descriptors (RLIMIT_NOFILE).")
    file_mb: int = Field(16, ge=1, le=1024, description="Largest file the program may write, in MiB (RLIMIT_FSIZE); "
                         "the scratch directory as a whole is a tmpfs of `scratch_mb`.")
    scratch_mb: int = Field(64, ge=1, le=4096, description="Size of the writable scratch directory (/tmp, a tmpfs).")
    output_bytes: int = Field(1 << 20, ge=1024, le=256 << 20, description="stdout and stderr together; past it the "
                              "sandbox is killed and the outcome is 'output_limit'.")
    program_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest program plus tests accepted; a "
                               "larger one is 'refused' without running.")


class SandboxSettings(BaseModel):
    """The operator's sandbox: the pool and what the sandbox may see. `from_environment` reads LOCKSTEP_SANDBOX_*."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(2, ge=1, le=256, description="Executions at once (LOCKSTEP_SANDBOX_WORKERS). About one per "
                         "core the host can spare: each is one Python process.")
    bwrap: str = Field("bwrap", description="The bubblewrap executable (LOCKSTEP_SANDBOX_BWRAP), a name on PATH or an "
                       "absolute path.")
    python: str = Field(default_factory=lambda: default_python(), description="Interpreter run inside the sandbox "
                        "(LOCKSTEP_SANDBOX_PYTHON); default: the one running this service (without its virtualenv) "
                        "when every directory above it is open to other users, else /usr/bin/python3 (a uid the "
                        "pool drops to could not reach one under a private home). It must lie inside `read_only`.")
    read_only: tuple[str, ...] = Field(
        default_factory=lambda: default_read_only(default_python()),
        description="Directories mounted read-only into the sandbox at the same path (LOCKSTEP_SANDBOX_READ_ONLY, "
        "comma-separated): the interpreter, its standard library and the shared libraries it loads. Nothing "
        "else of the host is visible. Never a directory holding secrets, checkpoints or the run directories.")
    uid: int = Field(NOBODY, ge=1, le=2**31 - 2, description="When the pool runs as root, each sandbox starts as this "
                     "uid and gid (LOCKSTEP_SANDBOX_UID), so even its user namespace maps to no privileged user on the "
                     "host. Ignored when not root: the sandbox then runs as the service's own uid, in its own user "
                     "namespace.")

    @field_validator("read_only", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("read_only")
    @classmethod
    def _absolute(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one directory (the interpreter's)")
        for path in value:
            resolved = os.path.realpath(path)
            if not os.path.isabs(path) or resolved == "/":
                raise ValueError(f"{path!r} must be an absolute directory other than '/'")
        return tuple(os.path.realpath(p) for p in value)

    def check_interpreter(self) -> None:
        """ValueError naming `python` when it is not inside `read_only` (it would not exist in the sandbox)."""
        python = Path(os.path.realpath(self.python))
        if not any(python.is_relative_to(root) for root in self.read_only):
            raise ValueError(f"python: {python} is not inside read_only {list(self.read_only)}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> "SandboxSettings":
        """Settings from LOCKSTEP_SANDBOX_<FIELD> variables; ValueError naming the variable for a bad value."""
        environ = os.environ if environ is None else environ
        values = {name: environ[f"LOCKSTEP_SANDBOX_{name.upper()}"] for name in cls.model_fields
                  if f"LOCKSTEP_SANDBOX_{name.upper()}" in environ}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = f"LOCKSTEP_SANDBOX_{str(err['loc'][0]).upper()}" if err["loc"] else "LOCKSTEP_SANDBOX_*"
            raise ValueError(f"{name}: {err['msg'].removeprefix('Value error, ')}") from None
