"""``calculator``: an exact arithmetic tool; reward = correctness of the final answer.

The tool evaluates + - * / // % ** and parentheses over integers and decimals exactly (rational
arithmetic, no floats, no ``eval``): a model that calls it gets numbers right that it cannot
compute itself. Exponents and operand sizes are bounded so a call cannot hang the pool.
"""
from __future__ import annotations

import ast
import operator
from fractions import Fraction
from typing import Any

from megarl.envs.base import EnvContext, Message
from megarl.envs.tool_env import ToolEnv, tool_prompt
from megarl.envs.tools import Tool

_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UN = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_DIGITS = 200


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (ValueError for anything else)."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UN:
            return _UN[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow):
                if b.denominator != 1 or abs(b) > MAX_EXPONENT:
                    raise ValueError(f"exponents must be integers of at most {MAX_EXPONENT}")
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
                raise ValueError("division by zero")
            out = Fraction(_BIN[type(node.op)](a, b))
            if len(str(out.numerator)) > MAX_DIGITS or len(str(out.denominator)) > MAX_DIGITS:
                raise ValueError(f"result longer than {MAX_DIGITS} digits")
            return out
        raise ValueError(f"unsupported element {type(node).__name__} (numbers and + - * / // % ** only)")

    return ev(tree)


def format_number(x: Fraction) -> str:
    """Integers as integers, other values as an exact fraction and a 12-digit decimal."""
    if x.denominator == 1:
        return str(x.numerator)
    return f"{x.numerator}/{x.denominator} (= {float(x):.12g})"


def calculator(expression: str) -> str:
    return format_number(evaluate(str(expression)))


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses).",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  calculator)


def question_messages(record: Any) -> list[Message]:
    """The record's prompt as chat messages (a string becomes one user message)."""
    prompt = record.prompt if hasattr(record, "prompt") else record["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def record_answer(record: Any) -> Any:
    return record.answer if hasattr(record, "answer") else record["answer"]


class CalculatorEnv(ToolEnv):
    """``env_args``: ``system_prompt`` (replaces the generated one), ``example`` (default true: one
    worked exchange -- question, call, result, answer -- before the question)."""

    tools = [CALCULATOR]
    INTRO = "You solve arithmetic problems. You have a calculator tool."
    # Without it SmolLM2-135M-Instruct never wrote a call in 352 sampled trajectories (20-step run
    # of the CPU recipe), so GRPO had nothing to reinforce; with it about a third of first turns
    # are calls (8 samples x 6 questions at T=1). Larger models follow the format anyway.
    EXAMPLE: list[Message] = [
        {"role": "user", "content": "Calculate 48 + 27."},
        {"role": "assistant",
         "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "48 + 27"}}</tool_call>'},
        {"role": "tool", "content": "75"},
        {"role": "assistant", "content": "75"},
    ]

    def __init__(self, ctx: EnvContext):
        super().__init__(ctx)
        self.system = ctx.args.get("system_prompt") or tool_prompt(self.tools, self.INTRO)
        self.example = list(self.EXAMPLE) if ctx.args.get("example", True) else []

    def opening(self, record: Any) -> list[Message]:
        return [{"role": "system", "content": self.system}] + self.example + question_messages(record)

    def score(self, text: str, record: Any) -> float:
        from megarl.rewards.rules import math_answer_reward

        return math_answer_reward(text, record_answer(record))
