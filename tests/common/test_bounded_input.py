"""Pure checks of untrusted input: JSON nesting and float32-representable floats."""
from __future__ import annotations

import json

import pytest

from services.common.bounded_json import JsonTooDeep, check_depth, loads_bounded
from services.common.float32_fields import FLOAT32_SMALLEST_NORMAL, check_float32


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def test_depth_is_counted_per_container_and_any_depth_is_safe():
    check_depth(json.loads(nested(4)), 4)
    with pytest.raises(JsonTooDeep) as err:
        check_depth(json.loads(nested(5)), 4)
    assert err.value.path == ("a",) * 4
    with pytest.raises(JsonTooDeep):
        check_depth(json.loads(nested(900)), 32)  # iterative: no RecursionError however deep


@pytest.mark.parametrize("text, fragment", [
    ("[" * 100_000 + "]" * 100_000, "cfg: nested deeper than"),   # json.loads itself raises RecursionError
    (nested(40), "cfg.a.a: nested deeper than 32"),
    ("{nope", "cfg: not valid JSON"),
    (" " * 11, "cfg: 11 bytes, more than the 10 allowed"),
])
def test_loads_bounded_refuses_naming_the_field(text, fragment):
    with pytest.raises(ValueError) as err:
        loads_bounded(text, field="cfg", max_bytes=10 if fragment.endswith("allowed") else 10**7)
    assert fragment in str(err.value)


@pytest.mark.parametrize("value", [0.0, 1.0, -2.5, FLOAT32_SMALLEST_NORMAL, 3.0e38])
def test_float32_carries_these(value):
    assert check_float32(value) == value


@pytest.mark.parametrize("value, fragment", [
    (1e-320, "underflows"), (1e-40, "underflows"), (1e39, "overflows"), (float("inf"), "finite"),
    (float("nan"), "finite"),
])
def test_float32_refuses_what_the_wire_would_change(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_float32(value)
