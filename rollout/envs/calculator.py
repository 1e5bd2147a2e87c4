"""A safe calculator: an arithmetic expression's value through Python's `ast`, never `eval`.

Numbers (int and float literals), + - * / // % **, unary + and -, parentheses, and the functions abs, round, min,
max, sqrt, floor, ceil. Everything else (names, attributes, calls of anything else, strings, comprehensions,
`__import__`) is refused with a `CalcError` saying what. Sizes are bounded so no expression can take the CPU or
the memory: at most `MAX_CHARS` characters, exponents at most `MAX_EXPONENT`, every intermediate value at most
`MAX_MAGNITUDE` in absolute value.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
CALC_SPEC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses, "
                       "abs, round, min, max, sqrt, floor, ceil.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}


class CalcError(ValueError):
    """The expression is not one the calculator evaluates; the message says why."""


_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "floor": math.floor, "ceil": math.ceil,
}


def calculate(expression: str) -> int | float:
    """The value of `expression`, or `CalcError`."""
    if not isinstance(expression, str):
        raise CalcError(f"expected the expression as a string, got {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"not an arithmetic expression: {expression.strip()[:60]!r}") from None
    return _eval(tree.body)


def format_number(value: int | float) -> str:
    """An integral value without a fractional part ("478", not "478.0"); others to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError(f"only numbers are allowed, got {node.value!r:.40}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except CalcError:
            raise
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError) as exc:
            raise CalcError(f"cannot compute: {exc}") from None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
        if node.keywords or not node.args:
            raise CalcError(f"{node.func.id}() takes numbers as positional arguments")
        args = [_eval(arg) for arg in node.args]
        try:
            return _bounded(_FUNCTIONS[node.func.id](*args))
        except CalcError:
            raise
        except (TypeError, ValueError, OverflowError) as exc:
            raise CalcError(f"{node.func.id}(): {exc}") from None
    if isinstance(node, ast.Call):
        raise CalcError(f"unknown function {ast.unparse(node.func)[:60]!r} (allowed: {', '.join(_FUNCTIONS)})")
    if isinstance(node, ast.Name):
        raise CalcError(f"unknown name {node.id!r}: only numbers and the functions {', '.join(_FUNCTIONS)}")
    raise CalcError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def _check_power(base: float, exponent: float) -> None:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent {format_number(exponent)} is too large (at most {MAX_EXPONENT})")
    if exponent > 0 and abs(base) > 1 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalcError(f"result too large (more than {MAX_MAGNITUDE:.0e})")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise CalcError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"result too large (more than {MAX_MAGNITUDE:.0e})")
    return value
