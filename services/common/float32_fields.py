"""Float fields that reach a float32 proto field (SamplingParams.temperature, top_p).

A JSON number is a float64; the wire rounds it to float32, where 1e-320 is 0.0
and 1e39 is inf. A value the wire would change that much is refused where it
is submitted, naming the field, instead of becoming a different value (or a
division by zero) in the engine.
"""
from __future__ import annotations

import math
from typing import Annotated

from pydantic import AfterValidator

FLOAT32_SMALLEST_NORMAL = 1.1754943508222875e-38
FLOAT32_MAX = 3.4028234663852886e38


def check_float32(value: float) -> float:
    """`value` unchanged if float32 carries it as a finite normal number (or exactly 0); ValueError otherwise."""
    if not math.isfinite(value):
        raise ValueError(f"must be finite, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{value} overflows float32 (max {FLOAT32_MAX:.7g})")
    if value != 0 and abs(value) < FLOAT32_SMALLEST_NORMAL:
        raise ValueError(f"{value} underflows float32 (smallest normal {FLOAT32_SMALLEST_NORMAL:.7g})")
    return value


Float32 = Annotated[float, AfterValidator(check_float32)]
"""A float the float32 wire carries without becoming 0, a denormal or inf."""
