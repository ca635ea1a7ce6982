"""The `calculator` environment: the model may call an integer calculator before it answers.

Protocol, one model turn at a time:
- a turn holding `<calc>EXPR</calc>` is a tool call: the observation is `<result>VALUE</result>`, or
  `<error>WHY</error>` when EXPR is refused; reward 0, the episode goes on;
- any other turn is the answer: reward 1.0 when the first integer in it equals the problem's answer,
  else 0; the episode ends.

EXPR is evaluated by walking its syntax tree (`ast.parse`, mode "eval"): integer literals, + - * // %,
unary + -, ** with a small exponent, and parentheses; nothing is executed, no names exist, and every size
is bounded before the work it bounds (the expression's length, each literal's digits, each exponent,
each intermediate result's magnitude), so no expression can take long or use much memory.
"""
from __future__ import annotations

import ast
import operator
import re

from pydantic import BaseModel, ConfigDict, Field

from contract.environment import Environment, EpisodeProblem, StepResult

MAX_EXPRESSION_CHARS = 200
"""Longest expression the calculator reads (ast.parse's own nesting limit is far above what fits)."""
MAX_LITERAL_DIGITS = 30
MAX_EXPONENT = 64
MAX_RESULT_DIGITS = 100
"""Largest magnitude of any intermediate value, in decimal digits: 10**100 fits; 10**101 is refused."""
_MAX_MAGNITUDE = 10**MAX_RESULT_DIGITS
_MAX_NODES = 200

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")


class CalculatorError(ValueError):
    """The expression is refused; the message says why (it becomes the observation)."""


def _bounded(value: int) -> int:
    if abs(value) > _MAX_MAGNITUDE:
        raise CalculatorError(f"result exceeds 10**{MAX_RESULT_DIGITS}")
    return value


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        # bool is an int subclass; True is not a literal this calculator reads.
        if type(node.value) is not int:
            raise CalculatorError(f"only integer literals, not {type(node.value).__name__}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if not 0 <= right <= MAX_EXPONENT:
                raise CalculatorError(f"exponent must be in 0..{MAX_EXPONENT}")
            # |left| <= 10**100 and right <= 64 would be ~6400 digits: bound it by logarithm first.
            if left not in (-1, 0, 1) and (len(str(abs(left))) - 1) * right > MAX_RESULT_DIGITS:
                raise CalculatorError(f"result exceeds 10**{MAX_RESULT_DIGITS}")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed")


def evaluate(expression: str) -> int:
    """The integer value of `expression`, or CalculatorError saying why it is refused."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    # Literal digits are bounded in the text, before ast.parse converts them (int() of a long literal is
    # quadratic, and Python refuses past 4300 digits with its own error).
    for digits in re.findall(r"\d+", expression):
        if len(digits) > MAX_LITERAL_DIGITS:
            raise CalculatorError(f"a literal longer than {MAX_LITERAL_DIGITS} digits")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > _MAX_NODES:
        raise CalculatorError(f"more than {_MAX_NODES} syntax nodes")
    try:
        return _eval(tree)
    except RecursionError:
        raise CalculatorError("nested too deeply") from None


class CalculatorOptions(BaseModel):
    """Options of the `calculator` environment."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    correct_reward: float = Field(1.0, ge=0.0, le=1.0, description="Reward of a correct final answer.")


class CalculatorEnvironment(Environment):
    def __init__(self, options: CalculatorOptions):
        self.options = options
        self.problem: EpisodeProblem | None = None
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, problem: EpisodeProblem) -> str:
        self.problem = problem
        return problem.prompt

    def step(self, model_turn: str) -> StepResult:
        assert self.problem is not None, "step() before reset()"
        call = _CALL.search(model_turn)
        if call is not None:
            self.tool_calls += 1
            try:
                return StepResult(f"<result>{evaluate(call.group(1))}</result>", 0.0, False, tool_call=True)
            except CalculatorError as exc:
                self.tool_errors += 1
                return StepResult(f"<error>{exc}</error>", 0.0, False, tool_call=True, tool_error=True)
        found = _INTEGER.search(model_turn)
        correct = found is not None and found.group(0) == self.problem.answer
        return StepResult("", self.options.correct_reward if correct else 0.0, True)

