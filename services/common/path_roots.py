"""Directories the operator allows: every path from a run spec or an RPC must resolve inside one.

A path is resolved (symlinks followed, `..` collapsed, relative to the working
directory) before it is compared, so neither `..` nor a symlink out of a root
gets past; the check comes before the path is opened or even tested for
existence, so a refused path answers the same whether or not it exists.

Roots are a service's own configuration (`model_roots`, `checkpoint_roots`,
...), given as a list or a comma-separated string. "/" is refused: a root that
allows every path is no confinement.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BeforeValidator

DEFAULT_ROOTS = ("runs",)
"""The repository's own run directory (relative to the working directory, like data_dir's default)."""


class OutsideRoots(ValueError):
    """The path resolves outside every allowed root; the message names the field."""


def _split(value: object) -> object:
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    return value


def resolve_roots(roots: list[str]) -> list[str]:
    """Absolute, symlink-free roots; ValueError for none at all or for '/'."""
    if not roots:
        raise ValueError("at least one directory is required")
    out = []
    for root in roots:
        resolved = Path(root).resolve()
        if resolved == Path(resolved.anchor):
            raise ValueError(f"{root!r} is the file system root, which would allow every path")
        out.append(str(resolved))
    return out


RootList = Annotated[list[str], BeforeValidator(_split), AfterValidator(resolve_roots)]
"""A config field's type: comma-separated or list input, resolved roots out."""


def resolve_inside(value: str, roots: Sequence[str | Path], field: str) -> Path:
    """`value` resolved, if it lies inside one of `roots` (each already resolved); OutsideRoots otherwise.

    Never touches what the path names beyond resolving symlinks on the way."""
    if not isinstance(value, str) or not value:
        raise OutsideRoots(f"{field}: must be a non-empty path")
    if "\x00" in value:
        raise OutsideRoots(f"{field}: contains a NUL character")
    try:
        path = Path(value).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # symlink loops, names the OS cannot take
        raise OutsideRoots(f"{field}: cannot be resolved ({exc})") from None
    for root in roots:
        if path.is_relative_to(root):
            return path
    raise OutsideRoots(f"{field}: {value!r} is outside the allowed roots ({', '.join(str(r) for r in roots)})")
