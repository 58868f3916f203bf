"""The ``calculator`` environment: arithmetic word problems solved with a calculator tool.

The policy may call ``calculator(expression)`` (numbers, ``+ - * /``, parentheses, unary minus) as often as it
likes; its first turn without a call is its answer. The expression is evaluated by parsing (:func:`evaluate`, a
recursive-descent parser over exact fractions), never by Python's ``eval``: a call the parser refuses gives an
``error: ...`` observation. Reward: when the row's ``extra_info`` has an ``"answer"`` (a number, or a GSM8K
solution ending ``#### <number>`` as verl's GSM8K preprocessing writes it), 1.0 if the answer turn's last number
equals it (:func:`hybridrl.rewards.gsm8k.compute_score`, "flexible"), else 0; without one, None (a scorer or a
reward model gives the reward).

:func:`make_calculator_task` makes the CPU demo's word problems ("Ann has 37 apples and buys 48 more. How many
apples now?"); :func:`demo_turns` writes the tool-using answer to one, the traces the demo model is warmed up on.
"""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from typing import Any

from hybridrl.rewards import gsm8k
from hybridrl.rollout.agent.interface import Environment, Turn, tool
from hybridrl.rollout.agent.registry import register_environment

MAX_EXPRESSION_CHARS = 200
"""Longest expression :func:`evaluate` reads (bounds the work one call can ask for)."""
MAX_DEPTH = 32
"""Deepest parenthesis nesting :func:`evaluate` reads."""
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(.))")


class CalculatorError(ValueError):
    """An expression the calculator refuses (the tool's observation is its message)."""


class _Parser:
    """expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*; factor := ('-'|'+') factor | number |
    '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        for number, other in _TOKEN.findall(text):
            if number:
                self.tokens.append(("num", number))
            elif other.strip():
                if other not in "+-*/()":
                    raise CalculatorError(f"unexpected character {other!r}; use numbers, + - * / and parentheses")
                self.tokens.append(("op", other))
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise CalculatorError("the expression ends too early")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op, rhs = self.take()[1], self.term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op, rhs = self.take()[1], self.factor(depth)
            if op == "/" and rhs == 0:
                raise CalculatorError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(self, depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise CalculatorError(f"the expression nests deeper than {MAX_DEPTH} levels")
        kind, text = self.take()
        if kind == "num":
            return Fraction(text)
        if text in ("-", "+"):
            value = self.factor(depth + 1)
            return -value if text == "-" else value
        if text == "(":
            value = self.expr(depth + 1)
            if self.take()[1] != ")":
                raise CalculatorError("a parenthesis is not closed")
            return value
        raise CalculatorError(f"unexpected {text!r}")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (numbers, ``+ - * /``, parentheses, unary signs).

    Raises:
        CalculatorError: anything else (names, ``**``, unbalanced parentheses, division by zero, too long).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    parser = _Parser(expression)
    value = parser.expr(0)
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after the expression")
    return value


def format_number(value: Fraction) -> str:
    """An integer as is (``85``), anything else to 6 decimals without trailing zeros (``2.333333``)."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


@register_environment("calculator")
class CalculatorEnvironment(Environment):
    """Word problems with a calculator tool; see the module docstring."""

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate arithmetic: numbers, + - * / and parentheses.

        Args:
            expression: e.g. "(12+30)*2"
        """
        return format_number(evaluate(expression))

    def reward(self, turn: Turn) -> float | None:
        answer = self.extra_info.get("answer")
        if answer is None:
            return None
        if turn.tool_calls:  # still calling tools when the trajectory ended: no answer given
            return 0.0
        return gsm8k.compute_score(turn.text, answer, method="flexible")


DATA_SOURCE = "hybridrl/agent_calculator"
"""``data_source`` of the demo rows."""
_NAMES = ("Ann", "Bob", "Cai", "Dee", "Eli", "Fay")
_ITEMS = ("apples", "pens", "cards", "coins", "books", "stamps")
_TEMPLATES = {
    "+": "{name} has {a} {item} and buys {b} more. How many {item} now?",
    "-": "{name} has {a} {item} and gives away {b}. How many {item} are left?",
    "*": "{name} buys {a} boxes of {b} {item}. How many {item} in all?",
}


def make_calculator_task(n: int, seed: int = 0, split: str = "train", plain: bool = False) -> list[dict[str, Any]]:
    """``n`` word problems in the dataset schema: one user turn, ``extra_info`` with the ``answer`` and the
    ``expression`` that computes it (two-digit terms; one-digit box counts for products).

    Args:
        n: rows.
        seed: RNG seed (the same seed gives the same rows).
        split: stored in ``extra_info``.
        plain: ask "What is 37+48?" instead of a word problem (the tiny CPU demo: its 2-layer model learns to
            copy an expression into a call in a few dozen warm-up steps, not to read a story).
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 9), rng.randint(10, 99)) if op == "*" else (rng.randint(10, 99), rng.randint(10, 99))
        if op == "-" and b > a:
            a, b = b, a
        expression = f"{a}{op}{b}"
        answer = format_number(evaluate(expression))
        question = _TEMPLATES[op].format(name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b)
        if plain:
            question = f"What is {expression}?"
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"answer": answer, "expression": expression, "split": split, "index": i},
        })  # fmt: skip
    return rows


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call in the Hermes format the ``hermes`` parser reads (compact JSON, as the tools prompt shows it)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments}, separators=(',', ':'))}</tool_call>"


CALL_OPEN = '<tool_call>{"name":"calculator","arguments":{"expression":"'
CALL_CLOSE = '"}}</tool_call>'
"""The text around the expression in :func:`tool_call_text` of a calculator call (single tokens of the demo's
tokenizer: the tiny demo model then learns what to compute, not how to spell JSON)."""


def demo_turns(row: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The tool-using answer to a :func:`make_calculator_task` row: ``[(policy text, tool output), ...]``, the
    last turn without a tool output (the answer)."""
    info = row["extra_info"]
    return [(tool_call_text("calculator", {"expression": info["expression"]}), info["answer"]), (info["answer"], None)]
