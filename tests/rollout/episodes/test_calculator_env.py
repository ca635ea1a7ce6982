"""The calculator environment's evaluator: arithmetic by walking the syntax tree, every size bounded."""
from __future__ import annotations

import pytest

from contract.environment import EpisodeProblem, StepResult, check_observation, check_step_result, EndReason, \
    ObservationRefused
from services.environments.calculator import (
    MAX_EXPRESSION_CHARS, CalculatorEnvironment, CalculatorError, CalculatorOptions, evaluate,
)


@pytest.mark.parametrize("expression,value", [
    ("6*7", 42), ("(12+30)*2 - 4", 80), ("-5 // 2", -3), ("17 % 5", 2), ("2**10", 1024), ("+-3", -3),
    ("10**50 * 10**50", 10**100), ("(-1)**64", 1),
])
def test_arithmetic_is_evaluated(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression,why", [
    ("__import__('os').system('true')", "not allowed"),
    ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "not allowed"),
    ("(1).__class__", "not allowed"),
    ("[1, 2]", "not allowed"),
    ("1 if 1 else 2", "not allowed"),
    ("lambda: 1", "not allowed"),
    ("1.5 * 2", "only integer literals"),
    ("True + 1", "only integer literals"),
    ("'a' * 3", "only integer literals"),
    ("1 / 2", "not allowed"),
    ("1 // 0", "division by zero"),
    ("1 % 0", "division by zero"),
    ("2 ** 65", "exponent"),
    ("2 ** -1", "exponent"),
    ("9 ** 9 ** 9", "exponent"),
    ("(10**60) ** 2", "exceeds"),
    ("10**50 * 10**51", "exceeds"),
    ("1" * 31, "literal longer"),
    ("1+" * 120 + "1", "longer than"),
    ("(" * 99 + "1" + ")" * 99, None),  # fits the length bound: parsed or refused, never a crash
    ("1 +", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("1; 2", "not an arithmetic expression"),
    ("0x" + "f" * 100, "exceeds"),
    ("-" * 190 + "1", None),
])
def test_anything_else_is_refused_with_a_reason(expression, why):
    if why is None:
        try:
            evaluate(expression)
        except CalculatorError:
            pass
        return
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_the_expression_length_bound_is_checked_first():
    assert len("1+" * 120 + "1") > MAX_EXPRESSION_CHARS


def test_an_episode_calls_the_tool_then_answers():
    env = CalculatorEnvironment(CalculatorOptions())
    assert env.reset(EpisodeProblem("p", "37*41=", "1517")) == "37*41="
    assert env.step("let me see <calc>37*41</calc>") == StepResult("<result>1517</result>", 0.0, False, True)
    assert env.step("<calc>37*</calc>") == StepResult("<error>not an arithmetic expression</error>", 0.0, False,
                                                      True, True)
    assert (env.tool_calls, env.tool_errors) == (2, 1)
    assert env.step("1517") == StepResult("", 1.0, True)
    env.reset(EpisodeProblem("p", "37*41=", "1517"))
    assert env.step("the answer is 1518") == StepResult("", 0.0, True)


def test_observations_are_checked_for_size_and_utf8():
    assert check_observation(b"caf\xc3\xa9", 16) == "café"
    assert check_observation("é" * 8, 16) == "é" * 8
    for value, reason in [("é" * 9, EndReason.OBSERVATION_TOO_LARGE), (b"\xff", EndReason.OBSERVATION_NOT_UTF8),
                          ("\udc80", EndReason.OBSERVATION_NOT_UTF8), (b"z" * 17, EndReason.OBSERVATION_TOO_LARGE),
                          (3, EndReason.BAD_RESULT)]:
        with pytest.raises(ObservationRefused) as refused:
            check_observation(value, 16)
        assert refused.value.reason is reason
    assert check_step_result(("ok", 1, False), 16) == StepResult("ok", 1.0, False)
    assert check_step_result(StepResult("ok", 0.0, False, True, True), 16) == StepResult("ok", 0.0, False, True, True)
    with pytest.raises(ObservationRefused, match="tool_call and tool_error must be bool"):
        check_step_result(StepResult("ok", 0.0, False, 1), 16)
    for bad in [("ok", True, False), ("ok", float("inf"), False), ("ok", 0.0, 1), ("ok", 0.0)]:
        with pytest.raises(ObservationRefused) as refused:
            check_step_result(bad, 16)
        assert refused.value.reason is EndReason.BAD_RESULT


def test_number_guess_gives_feedback_until_the_number_is_found():
    from services.environments.number_guess import GuessEnvironment, GuessOptions

    env = GuessEnvironment(GuessOptions())
    assert env.reset(EpisodeProblem("p", "guess 0-99:", "42")) == "guess 0-99:"
    assert env.step("maybe 17?") == StepResult(" higher: ", 0.0, False)
    assert env.step("90") == StepResult(" lower: ", 0.0, False)
    assert env.step("no idea") == StepResult(" no number: ", 0.0, False)
    assert env.step("it is 42, then 7") == StepResult("", 1.0, True)
