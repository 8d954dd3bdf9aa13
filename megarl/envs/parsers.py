"""Tool-call parsers: the chat template's own tool-call format, found in a model turn's text.

* ``hermes`` (Qwen2.5/Qwen3, Hermes, SmolLM-style ChatML templates): zero or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the text.
* ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole turn is one JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``); several calls
  separated by ``;``.

A parser never raises on model output: what it cannot read becomes a one-line error that the
environment shows the model as an observation (a malformed call is a learnable mistake, not a
crash). Pluggable: ``agent.tool_parser`` names a built-in or a dotted ``module:function``
returning ``(tool_calls, errors)``.
"""
from __future__ import annotations

import importlib
import json
import re
from typing import Any, Callable

from megarl.envs.base import ToolCall

Parser = Callable[[str], tuple[list[ToolCall], list[str]]]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ToolCall:
    """A ToolCall from a decoded JSON object, or ValueError with the reason."""
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError('a tool call needs a "name" string')
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):           # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments of {name!r} are not valid JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise ValueError(f'"{args_keys[0]}" of {name!r} must be a JSON object')
    return ToolCall(name, args)


def _parse_each(bodies: list[str], arg_keys: tuple[str, ...]) -> tuple[list[ToolCall], list[str]]:
    """Each JSON body as one call; a body that is not one becomes an error for the model."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in bodies:
        try:
            calls.append(_call_from(json.loads(body), arg_keys))
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {body.strip()[:200]}")
        except ValueError as e:
            errors.append(str(e))
    return calls, errors


def hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    calls, errors = _parse_each(_HERMES.findall(text), ("arguments", "parameters"))
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        errors.append("unclosed <tool_call>: write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>")
    return calls, errors


def llama3_json(text: str) -> tuple[list[ToolCall], list[str]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(end).strip()
    if not body.startswith("{"):
        return [], []                    # plain text: a final answer
    parts = [body]
    if ";" in body:                      # several calls "{...}; {...}" -- unless ";" is inside one object
        try:
            json.loads(body)
        except json.JSONDecodeError:
            parts = [p for p in body.split(";") if p.strip()]
    return _parse_each(parts, ("parameters", "arguments"))


PARSERS: dict[str, Parser] = {"hermes": hermes, "qwen": hermes, "llama3_json": llama3_json}


def get_parser(name: str) -> Parser:
    """A built-in parser by name, or ``module:function``."""
    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise ValueError(f"agent.tool_parser: unknown parser {name!r} (built-ins: {sorted(PARSERS)}, or module:function)")
    module, attr = name.split(":", 1)
    return getattr(importlib.import_module(module), attr)
