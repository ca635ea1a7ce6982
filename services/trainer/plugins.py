"""Attention backends registered by modules named in the trainer's configuration.

Apart from the server so that every data-parallel rank can import them without gRPC."""
from __future__ import annotations

import importlib


def import_attention_plugins(modules: list[str]) -> None:
    """Import modules that register extra attention backends; a missing one stops start-up."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise RuntimeError(f"attention_plugins: cannot import {name!r}: {exc}") from exc
