"""What a scorer answered, read as a score or refused with a reason. Pure functions, no I/O.

A scorer replica is a model: its answer is data to check, not a reward. A judge's verdict that does not parse,
a score that is not finite or lies outside the spec's range, an answer missing an item: each is refused
with one of FAILURE_REASONS, and the caller retries the item or drops it (rewards/scoring.py), counting the
reason. Nothing here turns a refusal into a default score.
"""
from __future__ import annotations

import json
import math
import re
from services.coordinator.rewards.spec import ScoreRange, VerdictParser

FAILURE_REASONS = ("unparsable", "non_finite", "out_of_range", "malformed", "timeout", "scorer_unavailable",
                   "scorer_error")
"""Why an item got no score from one attempt: its verdict did not parse, its score was NaN or infinite, or
outside the range; the answer lacked it, named it twice, or carried the wrong field (malformed); the call ran
past its deadline; the scorer could not be reached (a dead replica); the scorer refused the call."""


class ScoreRefused(Exception):
    """One item's attempt gave no score: `reason` (one of FAILURE_REASONS) and what was seen."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {reason!r}")
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ScoreRefused("unparsable", f"{what} is {type(value).__name__}, not a number")
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise ScoreRefused("unparsable", f"{what} {str(value)[:80]!r} is not a number") from None


def _first_json_object(text: str) -> dict | None:
    decoder = json.JSONDecoder()
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def read_verdict(text: str, parser: VerdictParser) -> float:
    """The number a judge's verdict states, by the spec's parser; ScoreRefused('unparsable') if it states none.
    Not yet range-checked (check_score does that)."""
    if parser.kind == "regex":
        match = re.search(parser.pattern, text)
        if match is None:
            raise ScoreRefused("unparsable", f"no match of {parser.pattern!r} in {text[:120]!r}")
        found = match.group(1) if match.re.groups else match.group(0)
        if found is None:
            raise ScoreRefused("unparsable", f"the group of {parser.pattern!r} matched nothing in {text[:120]!r}")
        return _number(found.strip(), "the matched text")
    obj = _first_json_object(text)
    if obj is None:
        raise ScoreRefused("unparsable", f"no JSON object in {text[:120]!r}")
    if parser.field not in obj:
        raise ScoreRefused("unparsable", f"the JSON object has no field {parser.field!r}")
    value = obj[parser.field]
    if isinstance(value, str):  # "7" in a JSON verdict is a string, not the number the rubric asked for
        raise ScoreRefused("unparsable", f"field {parser.field!r} is a string, not a number")
    return _number(value, f"field {parser.field!r}")


def check_score(value: float, score_range: ScoreRange | None) -> float:
    """`value` if it is finite and inside `score_range` (inclusive; None: any finite value)."""
    if not math.isfinite(value):
        raise ScoreRefused("non_finite", f"score {value}")
    if score_range is not None and not score_range.low <= value <= score_range.high:
        raise ScoreRefused("out_of_range", f"score {value} outside [{score_range.low}, {score_range.high}]")
    return value
