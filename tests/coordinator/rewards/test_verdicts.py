"""Reading a scorer's answer: a verdict that does not parse, a score that is not finite or out of range is
refused with its reason, never read as a number; the judge template substitutes only its three fields."""
from __future__ import annotations

import math

import pytest

from contract.judge_template import check_template, render_template, template_sha256
from services.coordinator.rewards.spec import ScoreRange, VerdictParser
from services.coordinator.rewards.verdicts import ScoreRefused, check_score, read_verdict

REGEX = VerdictParser(kind="regex", pattern=r"Score:\s*(-?\d+(?:\.\d+)?)")
JSON = VerdictParser(kind="json", field="score")
RANGE = ScoreRange(low=0, high=10)


@pytest.mark.parametrize("text, parser, expected", [
    ("The answer is right. Score: 7", REGEX, 7.0),
    ("Score: 2.5 and later Score: 9", REGEX, 2.5),          # the first match
    ('thinking... {"score": 8, "why": "ok"}', JSON, 8.0),
    ('{"other": 1} then {"score": 3.5}', JSON, None),       # the first object lacks the field: refused
])
def test_a_verdict_is_read_by_its_parser(text, parser, expected):
    if expected is None:
        with pytest.raises(ScoreRefused) as info:
            read_verdict(text, parser)
        assert info.value.reason == "unparsable"
    else:
        assert read_verdict(text, parser) == expected


@pytest.mark.parametrize("text, parser", [
    ("no score here", REGEX),
    ("Score: seven", REGEX),
    ("not json {", JSON),
    ('{"score": "7"}', JSON),      # a string is not the number the rubric asked for
    ('{"score": true}', JSON),     # nor is a boolean
    ('{"score": null}', JSON),
    ('{"score": [7]}', JSON),
    ("", REGEX),
])
def test_a_verdict_that_states_no_number_is_unparsable(text, parser):
    with pytest.raises(ScoreRefused) as info:
        read_verdict(text, parser)
    assert info.value.reason == "unparsable"


def test_a_whole_match_is_read_when_the_pattern_has_no_group():
    assert read_verdict("grade 4/10", VerdictParser(kind="regex", pattern=r"\d+")) == 4.0


@pytest.mark.parametrize("value, reason", [(math.nan, "non_finite"), (math.inf, "non_finite"),
                                           (-math.inf, "non_finite"), (10.5, "out_of_range"), (-1e-9, "out_of_range")])
def test_a_score_that_is_not_finite_or_outside_the_range_is_refused(value, reason):
    with pytest.raises(ScoreRefused) as info:
        check_score(value, RANGE)
    assert info.value.reason == reason


def test_range_ends_are_inside_and_no_range_takes_any_finite_score():
    assert check_score(0.0, RANGE) == 0.0 and check_score(10.0, RANGE) == 10.0
    assert check_score(-1e30, None) == -1e30
    with pytest.raises(ScoreRefused):
        check_score(math.nan, None)


def test_parsed_nan_is_refused_not_passed_on():
    # float("nan") parses: the range check is what refuses it.
    value = read_verdict("Score: nan", VerdictParser(kind="regex", pattern=r"Score: (\w+)"))
    with pytest.raises(ScoreRefused) as info:
        check_score(value, RANGE)
    assert info.value.reason == "non_finite"


def test_an_unknown_reason_is_a_programming_error():
    with pytest.raises(ValueError):
        ScoreRefused("bad_vibes", "")


def test_the_template_substitutes_its_three_fields_once_and_nothing_else():
    template = 'Q {prompt} A {response} R {reference} keep {"score": n} and {{x}}'
    out = render_template(template, prompt="1+1=", response="{reference}", reference="2")
    assert out == 'Q 1+1= A {reference} R 2 keep {"score": n} and {{x}}'  # replaced text is not read again
    assert template_sha256(template) != template_sha256(template + " ")
    with pytest.raises(ValueError, match="answer"):
        check_template("{response} {answer}")
    with pytest.raises(ValueError, match="response"):
        check_template("{prompt} only")
    with pytest.raises(ValueError, match="unknown placeholder"):
        check_template("{response.__class__}x{respons}")
