"""How a value a run spec chose may appear on a child process's command line: pydantic only, no torch.

A run's engine options reach one command line, the SGLang server's, which
argparse reads. argparse takes any element that starts with '-' for an
option, so a value such as '--trust-remote-code' handed over as its own
element would be a flag the run chose. The rule, kept here in one place:

- every value a spec chooses keeps its own grammar: an enumeration, a number,
  or a token that does not start with '-' and holds no whitespace or NUL
  (ARG_VALUE_PATTERN);
- it is rendered as one `--flag=value` element, the flag being the code's;
- list values (argparse nargs options, which take one value after '=') are
  the flag followed by the items, each item a token of the same grammar.

The engine-option models declare the flag each field becomes with
`server_flag(...)`; the command builder (contract/sglang_command.py)
renders every SpecOption through `render_spec_options`, which checks the
grammar again at launch, so a value that got past a model is still refused.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel

ARG_VALUE_PATTERN = re.compile(r"[^-\s\x00][^\s\x00]*")
"""A run-chosen string on a command line: not starting with '-', no whitespace, no NUL."""
MAX_ARG_VALUE_LENGTH = 4096
"""Longest such string (Linux's PATH_MAX; the longest value is a model path)."""
FLAG_PATTERN = re.compile(r"--[a-z0-9][a-z0-9-]*")
"""What a flag name of the code's looks like."""
SERVER_FLAG_KEY = "server_flag"
"""The json_schema_extra key under which an engine option declares the server flag it becomes."""
SERVER_SWITCH_KEY = "server_switch"
"""The json_schema_extra key under which a boolean engine option declares the switch it turns on."""


def server_flag(flag: str) -> dict[str, str]:
    """`json_schema_extra` of an engine-option field whose value becomes `flag`'s value on the command line."""
    if not FLAG_PATTERN.fullmatch(flag):
        raise ValueError(f"not a flag name: {flag!r}")
    return {SERVER_FLAG_KEY: flag}


def server_switch(flag: str) -> dict[str, str]:
    """`json_schema_extra` of a boolean engine option that, when true, places the code's constant `flag`
    (a switch takes no value, so nothing the run wrote reaches the command line but its choice)."""
    if not FLAG_PATTERN.fullmatch(flag):
        raise ValueError(f"not a flag name: {flag!r}")
    return {SERVER_SWITCH_KEY: flag}


def chosen_switches(config: BaseModel) -> tuple[str, ...]:
    """The switches of every boolean field of `config` that declares one and is true, in field order."""
    out = []
    for name, info in type(config).model_fields.items():
        extra = info.json_schema_extra
        flag = extra.get(SERVER_SWITCH_KEY) if isinstance(extra, dict) else None
        if isinstance(flag, str) and getattr(config, name) is True:
            out.append(flag)
    return tuple(out)


def declared_flag(model: type[BaseModel], name: str) -> str:
    """The server flag field `name` of `model` declares; LookupError when it declares none."""
    extra = model.model_fields[name].json_schema_extra
    flag = extra.get(SERVER_FLAG_KEY) if isinstance(extra, dict) else None
    if not isinstance(flag, str):
        raise LookupError(f"{model.__name__}.{name} declares no server flag "
                          "(Field(json_schema_extra=server_flag(...)))")
    return flag


def command_line_fields(model: type[BaseModel]) -> dict[str, str]:
    """{field: flag} of every field of `model` that reaches a command line."""
    out = {}
    for name in model.model_fields:
        try:
            out[name] = declared_flag(model, name)
        except LookupError:
            continue
    return out


def check_arg_value(value: str, field: str) -> str:
    """`value` if a run may place it on a command line; ValueError naming `field` and why otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_ARG_VALUE_LENGTH:
        raise ValueError(f"{field}: longer than {MAX_ARG_VALUE_LENGTH} characters")
    if not ARG_VALUE_PATTERN.fullmatch(value):
        if value.startswith("-"):
            why = "starts with '-', which the server would read as an option"
        elif not value:
            why = "is empty"
        else:
            why = "holds whitespace or NUL"
        raise ValueError(f"{field}: {value!r} {why}; a value placed on a command line may not")
    return value


SpecValue = str | int | float | tuple[str, ...]


@dataclass(frozen=True)
class SpecOption:
    """One option of a child's command line whose value a run chose.

    `flag` is the code's (declared by the engine-option model); `value` is
    the run's, rendered and checked by render_spec_options only. `field`
    names where the value came from, for errors (`engine_config.server.dtype`).
    """

    field: str
    flag: str
    value: SpecValue


def spec_option(config: BaseModel, name: str, prefix: str = "") -> SpecOption:
    """Field `name` of `config` as the option its model declares (LookupError when it declares none)."""
    return SpecOption(f"{prefix}{name}", declared_flag(type(config), name), getattr(config, name))


def render_spec_options(options: Iterable[SpecOption]) -> list[str]:
    """The command-line elements of `options`: `--flag=value` each, a list as the flag then its items.

    ValueError naming the option's field for anything a run could use to add
    an option of its own: a string or list item outside ARG_VALUE_PATTERN, a
    bool, a non-finite float, an empty list, a flag that is not a flag name.
    """
    argv: list[str] = []
    for option in options:
        flag, value, field = option.flag, option.value, option.field
        if not FLAG_PATTERN.fullmatch(flag):
            raise ValueError(f"{field}: {flag!r} is not a flag name")
        if isinstance(value, bool):  # a switch is the code's constant flag, never a value
            raise ValueError(f"{field}: a boolean is not a command-line value")
        if isinstance(value, int):
            argv.append(f"{flag}={value}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{field}: {value!r} is not a finite number")
            argv.append(f"{flag}={value!r}")
        elif isinstance(value, str):
            argv.append(f"{flag}={check_arg_value(value, field)}")
        elif isinstance(value, tuple):
            if not value:
                raise ValueError(f"{field}: an empty list")
            items = [check_arg_value(item, f"{field}[{i}]") for i, item in enumerate(value)]
            # argparse gives an nargs option one value after '='; more follow as elements of their own.
            argv += [f"{flag}={items[0]}"] if len(items) == 1 else [flag, *items]
        else:
            raise ValueError(f"{field}: {type(value).__name__} is not a command-line value")
    return argv
