"""Which environments a run spec may name: the built-ins listed here, and any a process registers.

The built-ins are one explicit list, so what a run spec can pick is read here rather than gathered from
import side effects. A process may add more (`register_environment`: tests add hostile ones); a name is
taken once, and a built-in's name can never be taken by another environment.
"""
from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from contract.environment import Environment, EnvironmentEntry
from services.environments.calculator import CalculatorEnvironment, CalculatorOptions
from services.environments.number_guess import GuessEnvironment, GuessOptions

BUILTIN_ENVIRONMENTS: tuple[EnvironmentEntry, ...] = (
    EnvironmentEntry("calculator", CalculatorOptions, CalculatorEnvironment),
    EnvironmentEntry("number_guess", GuessOptions, GuessEnvironment),
)

_ENVIRONMENTS: dict[str, EnvironmentEntry] = {entry.name: entry for entry in BUILTIN_ENVIRONMENTS}


def register_environment(name: str, options_model: type[BaseModel],
                         factory: Callable[[BaseModel], Environment]) -> None:
    if name in _ENVIRONMENTS:
        raise ValueError(f"environment {name!r} is already registered")
    _ENVIRONMENTS[name] = EnvironmentEntry(name, options_model, factory)


def known_environments() -> tuple[str, ...]:
    return tuple(sorted(_ENVIRONMENTS))


def environment_options(name: str, options: dict) -> BaseModel:
    """Validated options of environment `name` (ValueError naming the environment and the option)."""
    return environment_entry(name).options_model.model_validate(dict(options), strict=True)


def environment_entry(name: str) -> EnvironmentEntry:
    try:
        return _ENVIRONMENTS[name]
    except KeyError:
        raise ValueError(f"unknown environment {name!r}; known: {sorted(_ENVIRONMENTS)}") from None

