"""The bubblewrap command line of one sandbox, and the check that the host can build one at all.

Why bubblewrap: it is one small setuid-free binary in every distribution (Debian's `bubblewrap`), used by
Flatpak, that builds each namespace from flags in one exec and exits with its child; nsjail does more (seccomp
policies, cgroups) but is not packaged in Debian, and firejail is a setuid binary with a large profile language.
What bubblewrap does not do (resource limits) the harness does with setrlimit, in the kernel.

The sandbox:
- new user, PID, network, IPC, UTS and (where the kernel has it) cgroup namespaces; no capabilities;
- as uid/gid 65534 inside its user namespace; started as `SandboxSettings.uid` when the pool runs as root;
- a filesystem of only the operator's read-only directories (the interpreter and its libraries), a fresh
  /proc of its own PID namespace, a minimal /dev, and /tmp: an empty tmpfs of
  `scratch_mb`, the working directory and the only writable place (the root itself is remounted read-only);
- an empty environment, no file descriptors but stdin, stdout and stderr, its own session (no terminal);
- the interpreter is the PID namespace's init (`--as-pid-1`): when it ends, the kernel kills every other
  process of the sandbox, and bubblewrap, its direct parent, reaps it, so the CPU time it used reaches the
  pool (os.wait4) and a SIGKILL from the CPU bound is told from one the program sent itself;
- `--die-with-parent`: killing bubblewrap kills the sandbox.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from services.common.sandbox.settings import NOBODY, SandboxLimits, SandboxSettings

HARNESS = Path(__file__).with_name("harness.py")
"""Its source is the sandboxed interpreter's `-c` program: no host file needs to be reachable by its uid."""
SCRATCH = "/tmp"


class SandboxUnavailable(RuntimeError):
    """The host cannot build the sandbox (no bubblewrap, no user namespaces): nothing runs unsandboxed."""


def resolve_bwrap(settings: SandboxSettings) -> str:
    path = shutil.which(settings.bwrap)
    if path is None:
        raise SandboxUnavailable(f"bubblewrap {settings.bwrap!r} is not installed or not on PATH "
                                 "(Debian/Ubuntu: apt-get install bubblewrap); the sandbox refuses to start")
    return path


def drops_to_uid(settings: SandboxSettings) -> int | None:
    """The uid the sandbox is started as (root drops to `settings.uid`), or None to keep the service's own."""
    return settings.uid if os.geteuid() == 0 else None


def bwrap_command(bwrap: str, settings: SandboxSettings, limits: SandboxLimits) -> list[str]:
    """argv of one execution: bubblewrap, then the interpreter running the harness."""
    cmd = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
           "--unshare-cgroup-try", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox",
           "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "PYTHONHASHSEED", "0", "--setenv", "HOME", SCRATCH]
    for path in settings.read_only:
        cmd += ["--ro-bind", path, path]
    for link in ("bin", "lib", "lib64", "sbin"):  # merged-/usr layouts reach the loader through these
        if os.path.islink(f"/{link}") and os.readlink(f"/{link}") == f"usr/{link}" and "/usr" in settings.read_only:
            cmd += ["--symlink", f"usr/{link}", f"/{link}"]
    cmd += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.scratch_mb << 20), "--tmpfs", SCRATCH,
            "--remount-ro", "/", "--chdir", SCRATCH,
            os.path.realpath(settings.python), "-I", "-S", "-B", "-c", harness_source()]
    return cmd


@functools.cache
def harness_source() -> str:
    return HARNESS.read_text(encoding="utf-8")


def probe(settings: SandboxSettings) -> str:
    """The bubblewrap path, after running an empty program in a sandbox built as every execution's is.
    SandboxUnavailable with bubblewrap's own words when it cannot (no user namespaces, a seccomp policy)."""
    settings.check_interpreter()
    bwrap = resolve_bwrap(settings)
    cmd = bwrap_command(bwrap, settings, SandboxLimits())[:-2] + ["-c", "import os; print(os.getuid())"]
    uid = drops_to_uid(settings)
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=30, env={}, stdin=subprocess.DEVNULL,
                              user=uid, group=uid, extra_groups=[] if uid is not None else None)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailable(f"bubblewrap could not start a sandbox: {exc}") from None
    if done.returncode != 0 or done.stdout.strip() != str(NOBODY).encode():
        why = done.stderr.decode("utf-8", "replace").strip()[-500:] or f"exit status {done.returncode}"
        raise SandboxUnavailable(f"the host cannot create the sandbox's namespaces ({why}); unprivileged user "
                                 "namespaces must be enabled (sysctl kernel.unprivileged_userns_clone=1, "
                                 "user.max_user_namespaces > 0, no AppArmor restriction on bwrap); "
                                 "nothing runs unsandboxed")
    return bwrap
