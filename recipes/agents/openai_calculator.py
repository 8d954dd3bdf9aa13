"""A tool-using agent written against the plain ``openai`` package -- nothing of megarl in it.

It is what a team would already have: a chat loop that offers a calculator tool, runs the calls
the model makes and sends the results back, until the model answers. megarl trains it unchanged
(``recipes/smollm2-135m-grpo-byo-agent-cpu.yaml``, ``agent.entrypoint:
recipes/agents/openai_calculator.py:run``): it calls ``run`` once per trajectory with the base URL
of its gateway, a key of that trajectory's own and the data record, and records every call token
for token. ``run`` returns None, so megarl's reward function (``reward.*``) scores the final
answer; an agent with its own verifier would return the reward instead.

SmolLM2's chat template does not show tools to the model, so the system prompt lists them (a
Qwen-style template would render ``tools=`` itself), and one worked exchange shows the call format.
"""
from __future__ import annotations

import ast
import json
import operator
from fractions import Fraction

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression exactly (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

SYSTEM = ("You solve arithmetic problems. You have a calculator tool.\n\n"
          "Tools (call one by writing <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>):\n"
          + json.dumps(TOOLS[0]["function"])
          + "\nWhen you know the answer, reply with the answer only, without a tool call.")

EXAMPLE = [
    {"role": "user", "content": "Calculate 48 + 27."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps({"expression": "48 + 27"})}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "75"},
    {"role": "assistant", "content": "75"},
]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculate(expression: str) -> str:
    """Exact + - * / over numbers, or an error text for the model."""
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError("only numbers, + - * / and parentheses")
    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def question(record: dict) -> list[dict]:
    prompt = record["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def run(base_url: str, api_key: str, record: dict, max_turns: int = 3) -> None:
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}] + EXAMPLE + question(record)
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return None          # the final answer: megarl's reward function scores it
        for call in reply.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments).get("expression", ""))
            except (json.JSONDecodeError, AttributeError):
                result = "Error: arguments must be a JSON object with an expression"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
