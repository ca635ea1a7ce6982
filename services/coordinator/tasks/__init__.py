"""Task registry: run specs name a task; the coordinator builds it from its options."""
from __future__ import annotations

from collections.abc import Callable

from services.coordinator.tasks.base import Problem, Task


def _arithmetic(options: dict) -> Task:
    from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    return ArithmeticTask(ArithmeticConfig(**options))


def _math(options: dict) -> Task:
    from services.coordinator.tasks.math_dataset import MathConfig, MathTask

    return MathTask(MathConfig(**options))


_REGISTRY: dict[str, Callable[[dict], Task]] = {"arithmetic": _arithmetic, "math": _math}
# Options naming files the coordinator reads: each must lie inside the coordinator's data_roots.
_PATH_OPTIONS: dict[str, tuple[str, ...]] = {"math": ("path", "heldout_path")}


def task_path_options(name: str) -> tuple[str, ...]:
    """Names of the task's options that are file paths (read when the task is built)."""
    return _PATH_OPTIONS.get(name, ())


def known_tasks() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def build_task(name: str, options: dict) -> Task:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(_REGISTRY)}") from None
    try:
        return factory(dict(options))
    except TypeError as exc:
        raise ValueError(f"task {name!r} options: {exc}") from None


__all__ = ["Problem", "Task", "build_task", "known_tasks", "task_path_options"]
