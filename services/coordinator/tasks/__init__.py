"""Task registry: run specs name a task; the coordinator builds it from its options.

Each task's options are a strict pydantic model (no coercion: `digits: 5.5`
or `reverse_answer: 1` is refused), so a bad option is refused when the run
is submitted, with its name, never at run time.
"""
from __future__ import annotations

from collections.abc import Callable

from pydantic import ValidationError

from services.coordinator.tasks.base import Problem, Task


def _arithmetic(options: dict) -> Task:
    from services.coordinator.tasks.arithmetic import ArithmeticConfig, ArithmeticTask

    return ArithmeticTask(ArithmeticConfig.model_validate(options, strict=True))


def _math(options: dict) -> Task:
    from services.coordinator.tasks.math_dataset import MathConfig, MathTask

    return MathTask(MathConfig.model_validate(options, strict=True))


def _calculator(options: dict) -> Task:
    from services.coordinator.tasks.episodic import CalculatorConfig, CalculatorTask

    return CalculatorTask(CalculatorConfig.model_validate(options, strict=True))


def _number_guess(options: dict) -> Task:
    from services.coordinator.tasks.episodic import GuessConfig, GuessTask

    return GuessTask(GuessConfig.model_validate(options, strict=True))


def _code(options: dict) -> Task:
    from services.coordinator.tasks.code import CodeConfig, CodeTask

    return CodeTask(CodeConfig.model_validate(options, strict=True))


def _arithmetic_eval_set(options: dict, path: str, field: str) -> list[Problem]:
    from services.coordinator.tasks.arithmetic import ArithmeticConfig, read_eval_set

    return read_eval_set(path, field, ArithmeticConfig.model_validate(options, strict=True))


def _math_eval_set(options: dict, path: str, field: str) -> list[Problem]:
    from services.coordinator.tasks.math_dataset import MathConfig, read_eval_set

    return read_eval_set(path, field, MathConfig.model_validate(options, strict=True))


def _code_eval_set(options: dict, path: str, field: str) -> list[Problem]:
    from pathlib import Path

    from services.coordinator.tasks.code import CodeConfig, read_problems

    CodeConfig.model_validate(options, strict=True)
    return read_problems(Path(path), field)


_REGISTRY: dict[str, Callable[[dict], Task]] = {"arithmetic": _arithmetic, "math": _math,
                                                "calculator": _calculator, "number_guess": _number_guess,
                                                "code": _code}
_EVAL_SET_READERS: dict[str, Callable[[dict, str, str], list[Problem]]] = {
    "arithmetic": _arithmetic_eval_set, "math": _math_eval_set, "code": _code_eval_set}
# Options naming files the coordinator reads: each must lie inside the coordinator's data_roots.
_PATH_OPTIONS: dict[str, tuple[str, ...]] = {"math": ("path", "heldout_path"), "code": ("path", "heldout_path")}


def task_path_options(name: str) -> tuple[str, ...]:
    """Names of the task's options that are file paths (read when the task is built)."""
    return _PATH_OPTIONS.get(name, ())


def preload_tasks() -> None:
    """Import every task's heavy dependencies now (a service about to serve), not at the first submit."""
    from services.coordinator.tasks.math_dataset import preload

    preload()


def known_tasks() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def options_error(name: str, exc: ValidationError) -> str:
    """"task 'math' options.digits: Input should be a valid integer; ..." for every error of `exc`."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        parts.append(f"options.{loc}: {message}" if loc else f"options: {message}")
    return f"task {name!r} " + "; ".join(parts)


def read_eval_set(name: str, options: dict, path: str, field: str) -> list[Problem]:
    """The problems of an extra held-out JSONL file, read as task `name` with `options` reads its own data
    (prompts formatted and answers parsed the same way, so the task's scorer rewards them). ValueError
    starting with `field` for a missing file or a bad line; the options must already be valid."""
    try:
        reader = _EVAL_SET_READERS[name]
    except KeyError:
        raise ValueError(f"{field}: task {name!r} reads no eval sets") from None
    try:
        return reader(dict(options), path, field)
    except ValidationError as exc:
        raise ValueError(options_error(name, exc)) from None


def build_task(name: str, options: dict) -> Task:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(_REGISTRY)}") from None
    try:
        return factory(dict(options))
    except ValidationError as exc:
        raise ValueError(options_error(name, exc)) from None


__all__ = ["Problem", "Task", "build_task", "known_tasks", "preload_tasks", "read_eval_set", "task_path_options"]


def chat_prompt_problem(name: str, options: dict, eval_paths: list[str], model_path: str) -> tuple[str, str] | None:
    """(field, reason) when the task takes chat prompts the model's chat template cannot render (a model without
    one, or a chat it fails on, naming file:row), else None. A task without chat prompts reads no file again."""
    from services.coordinator.tasks.chat_template import ChatTemplate

    dataset = options.get("dataset")
    if not (isinstance(dataset, dict) and dataset.get("messages_field")):
        return None
    task = build_task(name, options)
    try:
        if not getattr(task, "chat_prompts", False):
            return None
        checks = [("task.options.dataset.messages_field", [*task.split("train"), *task.split("heldout")])]
        checks += [(f"eval.sets.{i}.path", read_eval_set(name, options, path, "path"))
                   for i, path in enumerate(eval_paths)]
    finally:
        task.close()
    try:
        template = ChatTemplate.from_model_dir(model_path)
    except ValueError as exc:
        return "task.options.dataset.messages_field", str(exc)
    for field, problems in checks:
        try:
            template.check(problems, field)
        except ValueError as exc:
            return field, str(exc).removeprefix(f"{field}: ")
    return None
