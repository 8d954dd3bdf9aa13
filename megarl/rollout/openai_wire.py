"""OpenAI's HTTP shapes, as the ``openai`` Python package sends and reads them: chat / text
completion requests in, completion objects and error bodies out.

Only what a bring-your-own agent needs from the gateway (``megarl/rollout/gateway.py``) is read;
everything here is plain dicts and pure functions, so the shapes are testable without a server.

Why sampling fields are mostly ignored: the trainer recomputes the logprobs of every sampled token
at the run's temperature (``rollout.sampling``), so an agent's ``temperature`` / ``top_p`` /
``logit_bias`` would make the rollout's logprobs disagree with the trainer's. The run's sampling
wins; ``max_tokens`` (or ``max_completion_tokens``) can only lower the run's per-turn limit.

Errors are ``{"error": {"message", "type", "code", "param"}}`` with an HTTP status the package
maps to its own exception classes (400 ``BadRequestError``, 401 ``AuthenticationError``, 5xx
``InternalServerError``, others ``APIStatusError``); final errors carry ``x-should-retry: false`` so
the package does not send a call again that cannot succeed.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.envs.base import ToolCall


class WireError(Exception):
    """A request the gateway answers with an OpenAI error body (status, type, code)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type_: str, code: Optional[str] = None, param: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


@dataclass
class CompletionRequest:
    """One call, as the gateway uses it: a conversation (chat) or a prompt (text), and a turn limit."""

    messages: Optional[list[dict[str, Any]]] = None       # chat: normalised messages
    prompt: Optional[str] = None                          # text completion
    tools: Optional[list[dict[str, Any]]] = None
    max_tokens: Optional[int] = None
    model: str = ""
    stream: bool = False                                  # answered as server-sent events, after the call
    include_usage: bool = False                           # stream_options.include_usage
    extra: dict[str, Any] = field(default_factory=dict)


def _int_or_none(body: dict[str, Any], *keys: str) -> Optional[int]:
    for key in keys:
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise WireError(400, f"{key} must be a positive integer, got {value!r}", param=key)
            return value
    return None


def _common(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (1, None):
        raise WireError(400, f"n must be 1 (one trajectory is one sequence), got {n!r}", param="n")
    options = body.get("stream_options") or {}
    return {"max_tokens": _int_or_none(body, "max_completion_tokens", "max_tokens"), "model": str(body.get("model") or ""),
            "stream": bool(body.get("stream")), "include_usage": bool(isinstance(options, dict) and
                                                                     options.get("include_usage"))}


def text_of(content: Any) -> str:
    """A message's ``content`` as text: a string, None (empty) or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise WireError(400, f"only text content parts are supported, got {part!r:.80}", param="messages")
        return "".join(parts)
    raise WireError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}",
                    param="messages")


def normalise_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``[{"id", "type", "function": {"name", "arguments"}}]``,
    arguments as a JSON string (what the package sends back)."""
    out = []
    for call in calls or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise WireError(400, f"a tool call needs function.name, got {call!r:.120}", param="messages")
        args = fn.get("arguments", "{}")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with text content; assistant ``tool_calls`` kept (normalised), tool messages keep
    ``tool_call_id`` / ``name``. Other keys are dropped: the chat template sees what it renders."""
    if not isinstance(messages, list) or not messages:
        raise WireError(400, "messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise WireError(400, f"each message needs a role, got {m!r:.120}", param="messages")
        msg: dict[str, Any] = {"role": m["role"], "content": text_of(m.get("content"))}
        if m["role"] == "developer":      # OpenAI's newer name for the system role
            msg["role"] = "system"
        if m.get("tool_calls"):
            msg["tool_calls"] = normalise_tool_calls(m["tool_calls"])
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = str(m[key])
        out.append(msg)
    return out


def chat_request(body: Any) -> CompletionRequest:
    common = _common(body)
    tools = body.get("tools") or None
    if tools is not None and not isinstance(tools, list):
        raise WireError(400, "tools must be a list", param="tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise WireError(400, "tool_choice must be auto or none (the model decides; forced calls would change its "
                        "distribution)", param="tool_choice")
    return CompletionRequest(messages=normalise_messages(body.get("messages")), tools=tools, **common)


def text_request(body: Any) -> CompletionRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise WireError(400, "prompt must be one string", param="prompt")
    return CompletionRequest(prompt=prompt, **common)


def openai_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Parsed calls as OpenAI ``tool_calls`` (arguments as a JSON string, ids unique)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def finish_reason(server: str, tool_calls: bool) -> str:
    """The server's ``stop`` / ``length`` as OpenAI's ``stop`` / ``length`` / ``tool_calls``."""
    if server == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(model: str, content: Optional[str], tool_calls: list[dict[str, Any]], finish: str,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def text_completion(model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": usage(prompt_tokens, completion_tokens)}


def stream_chunks(completion: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A finished completion as the chunks of a stream (``stream: true``): the whole text in one
    delta, the tool calls in the next, then the finish reason (and the usage when asked). The
    call is generated before the stream starts, so an error is still an ordinary error response."""
    head = {k: completion[k] for k in ("id", "created", "model")}
    choice = completion["choices"][0]
    chat = completion["object"] == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(body: dict[str, Any], finish: Optional[str] = None) -> dict[str, Any]:
        part = {"index": 0, **body, "finish_reason": finish, "logprobs": None}
        return {**head, "object": obj, "choices": [part]}
    if chat:
        message = choice["message"]
        out = [chunk({"delta": {"role": "assistant", "content": message.get("content") or ""}})]
        if message.get("tool_calls"):
            out.append(chunk({"delta": {"tool_calls": [dict(c, index=i) for i, c in enumerate(message["tool_calls"])]}}))
        out.append(chunk({"delta": {}}, choice["finish_reason"]))
    else:
        out = [chunk({"text": choice["text"]}), chunk({"text": ""}, choice["finish_reason"])]
    if include_usage:
        out.append({**head, "object": obj, "choices": [], "usage": completion["usage"]})
    return out


def model_list(model: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": 0, "owned_by": "megarl"}]}
