"""A calculator tool: exact integer and decimal arithmetic on an expression, evaluated without ``eval``.

The expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary signs and
parentheses are evaluated; anything else (names, calls, attributes) is an error shown to the model.
Integers are exact at any size; ``/`` gives a float (printed without a trailing ``.0`` when whole).
Work is bounded: the expression length, the exponent of ``**`` and the digits of any intermediate
integer are limited, so ``9**9**9`` is refused instead of hanging the rollout.
"""

from __future__ import annotations

import ast
import math
import operator

from rlflow.rollout.tools.base import Tool, ToolError

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str, *, max_length: int = 256, max_exponent: int = 1000, max_digits: int = 4000):
    """The value of an arithmetic ``expression`` (int or float); :class:`ToolError` for anything else.

    >>> evaluate("123 * 456"), evaluate("(7 - 2) / 4"), evaluate("2 ** 100 % 7")
    (56088, 1.25, 2)
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("calculator: empty expression")
    if len(expression) > max_length:
        raise ToolError(f"calculator: expression longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"calculator: cannot parse {expression!r} ({e.msg})") from None

    max_bits = int(max_digits * math.log2(10)) + 1

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise ToolError(f"calculator: exponent {right} is larger than {max_exponent}")
            if (isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int)
                    and left.bit_length() * right > max_bits):  # checked before the work, not after
                raise ToolError(f"calculator: result has more than {max_digits} digits")
            try:
                out = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("calculator: division by zero") from None
            except OverflowError:
                raise ToolError("calculator: result too large") from None
            if isinstance(out, int) and out.bit_length() > max_bits:
                raise ToolError(f"calculator: result has more than {max_digits} digits")
            if isinstance(out, complex):
                raise ToolError("calculator: complex result")
            return out
        raise ToolError(f"calculator: only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")

    return value(tree.body)


def format_number(x) -> str:
    """``56088``, ``1.25``, ``3`` for ``3.0``; ``inf``/``nan`` as Python prints them."""
    if isinstance(x, float) and math.isfinite(x):
        if x.is_integer() and abs(x) < 1e16:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)


class Calculator(Tool):
    """Evaluates an arithmetic expression (``{"expression": "123*456"}`` -> ``"56088"``).

    ``config`` keys: ``max_length``, ``max_exponent``, ``max_digits`` (see :func:`evaluate`), ``timeout_s``.
    """

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses; returns the number."
    parameters = {"type": "object", "properties": {
        "expression": {"type": "string", "description": "the expression, e.g. 123*456"}},
        "required": ["expression"]}
    timeout_s = 5.0

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self.limits = {k: int(self.config.pop(k)) for k in ("max_length", "max_exponent", "max_digits")
                       if k in self.config}
        # with a renamed schema the argument may be named otherwise: take the first required one
        required = self.parameters.get("required") or list(self.parameters.get("properties", {}))
        self.argument = required[0] if required else "expression"

    async def execute(self, args: dict, **sample_kwargs) -> str:
        return format_number(evaluate(str(args.get(self.argument, "")), **self.limits))
