"""The `calculator` tool: arithmetic evaluated by parsing, never by `eval`.

Read on: docs/envs.md.
"""

from __future__ import annotations

import ast
import math
import operator
import re

from cadence.envs.syntax import call_text, result_text

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_ABS = 10**15  # no intermediate value may exceed this in magnitude

_ALLOWED = re.compile(r"[\d\s.+\-*/%()]*")
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not arithmetic the calculator accepts; the message says why."""


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as text ("3 + 4" -> "7", "7 / 2" -> "3.5")."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    if not _ALLOWED.fullmatch(expression):  # before parsing: no names, strings or attributes
        raise CalculatorError("an expression may hold only digits, '.', + - * / % ( ) and spaces")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(
            f"not an arithmetic expression: {expression.strip()[:40]!r}"
        ) from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    return _format(_value(tree.body))


class Calculator:
    """The calculator as an environment class: one tool, and the run's reward function scores
    the answer (no `get_reward`)."""

    def reset(self, **row) -> None:
        return None  # stateless: the question is in the prompt

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

        Args:
            expression: The expression to evaluate, such as "123 + 456".
        """
        return calculator(expression)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"'{ast.unparse(node)[:40]}' is not a number or + - * / // % **")


def _check_power(base: int | float, exponent: int | float) -> None:
    if abs(exponent) > 64:
        raise CalculatorError("exponent larger than 64")
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > math.log10(MAX_ABS):
        raise CalculatorError(f"result larger than {MAX_ABS:.0e}")


def _bounded(x: int | float) -> int | float:
    if isinstance(x, complex) or not math.isfinite(x) or abs(x) > MAX_ABS:
        raise CalculatorError(f"result not a number below {MAX_ABS:.0e}")
    return x


def _format(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.10g}"


_WORKED_LINE = re.compile(r"^(?P<expression>[\d\s()+\-*/%.]+?)\s*=\s*-?[\d.]+$")


def demonstration(answer: str) -> list[tuple[str, bool]]:
    """A worked answer as (text, trained) segments in which the calculator does each step: a
    line "a op b = c" becomes the policy's call `<call>calculator: a op b</call>` and the tool's
    `<result>c</result>`; the final "#### N" line is the policy's, after a newline; other lines
    stay the policy's text."""
    segments: list[tuple[str, bool]] = []
    for line in answer.splitlines():
        worked = _WORKED_LINE.match(line.strip())
        if worked:
            expression = worked["expression"]
            segments += [
                (call_text("calculator", expression), True),
                (result_text(calculator(expression)), False),
            ]
        elif line.strip():
            segments.append(("\n" + line.strip() if segments else line.strip(), True))
    return segments
