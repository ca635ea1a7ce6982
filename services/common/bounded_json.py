"""JSON from untrusted senders, parsed with bounds on size and nesting.

`json.loads` recurses once per nesting level: a document a few thousand
levels deep raises RecursionError (not ValueError), and one a few hundred deep
parses but can fail later wherever the value is walked again (pydantic,
json.dumps, a response encoder). Every service edge that takes free-form JSON
(the REST run spec, LoadModel's engine_config_json) parses it here, so both
limits are refused at once as a ValueError naming the field.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

MAX_JSON_DEPTH = 32
"""Deepest nesting of objects/arrays accepted (the run spec's own schema needs 5)."""


class JsonTooDeep(ValueError):
    """A document nested deeper than allowed; `path` is where the limit was crossed."""

    def __init__(self, path: tuple[str, ...], max_depth: int) -> None:
        self.path = path
        self.max_depth = max_depth
        super().__init__(f"nested deeper than {max_depth} levels")


def _children(value: object) -> Iterator[tuple[str, object]]:
    if isinstance(value, dict):
        yield from ((str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        yield from ((str(i), v) for i, v in enumerate(value))


def check_depth(value: object, max_depth: int = MAX_JSON_DEPTH) -> None:
    """Raise JsonTooDeep if `value` nests containers deeper than max_depth. Iterative: any depth is safe."""
    stack: list[tuple[object, tuple[str, ...], int]] = [(value, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth + 1 > max_depth:
            raise JsonTooDeep(path, max_depth)
        stack.extend((child, (*path, key), depth + 1) for key, child in _children(node))


def loads_bounded(text: str | bytes, *, field: str, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> object:
    """Parse `text`; ValueError starting with `field` when it is too large, too deep or not JSON."""
    if len(text) > max_bytes:
        raise ValueError(f"{field}: {len(text)} bytes, more than the {max_bytes} allowed")
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{field}: nested deeper than {max_depth} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{field}: not valid JSON ({exc})") from None
    try:
        check_depth(value, max_depth)
    except JsonTooDeep as exc:
        where = ".".join((field, *exc.path[:2]))
        raise ValueError(f"{where}: {exc}") from None
    return value
