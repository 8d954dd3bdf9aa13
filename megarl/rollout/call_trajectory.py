"""A trajectory made of an agent's API calls: prompt ids, sampled ids and logprobs, call by call,
joined into sequences without ever re-tokenizing what the model sampled.

An agent that talks to the gateway (``megarl/rollout/gateway.py``) sends whole conversations:
each call repeats the history, including the assistant messages the gateway returned. Rendering
that history through the chat template and tokenizing it would give the model's earlier turns as
*text re-encoded* -- decode -> encode is not the identity (BPE merges across the turn boundary,
whitespace, a tool call the template re-serialises with other spacing), and training on tokens the
model did not sample is the drift the agentic-RL literature keeps reporting. So each new call is
matched against the open segments of its trajectory:

1. **extends**: the rendered prompt's ids start with a segment's ids so far (its first prompt, then
   sampled and template tokens): the new ids after them are appended (template / tool tokens, loss
   mask 0). Nothing re-encoded covers sampled tokens.
2. **splice**: the history up to the segment's last call is unchanged, the next message is the
   assistant reply the gateway gave (same content, same tool calls), but its re-rendering is not
   the sampled ids (re-tokenization drift). The template renders the new conversation with a
   sentinel in place of that reply: the text before the sentinel must be the segment's last prompt
   text (the rest matches), and the text after it (end of the assistant turn, tool results, the
   next generation prompt) is tokenized alone and appended after the *sampled* ids -- when the
   model's last token already is the template's end-of-turn, it is not added twice. The server
   then continues from exactly the trajectory's ids.
3. **new segment**: the agent rewrote its history (summarised, dropped or edited turns, another
   system prompt): the prompt is tokenized whole and starts a new segment.

How segments are trained (``agent.segments``): ``all`` -- every segment is a sample of its own in
the trajectory's group, each with the trajectory's reward; ``last`` -- only the segment of the
trajectory's last call. Text completions (``/v1/completions``) extend by ids, or splice when the
new prompt text is the last prompt text + the returned text + more.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from megarl.rollout.trajectory import SENTINEL, ChatTurns

_PROBE_TOOL = "megarl_probe_tool"


class ChatRender:
    """Conversations -> prompt text and ids through the tokenizer's own chat template.

    Templates that do not render an assistant message's ``tool_calls`` (SmolLM2's ChatML) get the
    calls written into the content in Hermes form (``<tool_call>{"name", "arguments"}</tool_call>``,
    the form the ``hermes`` parser reads), so the model sees its own calls in its history."""

    def __init__(self, tokenizer: Any, template_kwargs: Optional[dict[str, Any]] = None):
        self.turns = ChatTurns(tokenizer, template_kwargs)
        self.tok = tokenizer
        self.renders_tool_calls = self._probe_tool_calls()

    def _probe_tool_calls(self) -> bool:
        probe = [{"role": "user", "content": "?"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL, "arguments": {}}}]}]
        try:
            return _PROBE_TOOL in self.turns._render(probe, add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that chokes on tool_calls does not render them
            return False

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the template gets them: tool-call arguments as objects (templates serialise
        them with ``tojson``), or folded into the content where the template ignores tool calls."""
        out = []
        for m in messages:
            m = dict(m)
            calls = m.pop("tool_calls", None)
            if calls:
                parsed = [{"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])} for c in calls]
                if self.renders_tool_calls:
                    m["tool_calls"] = [{"id": c.get("id", ""), "type": "function", "function": p}
                                       for c, p in zip(calls, parsed)]
                else:
                    m["content"] = (m.get("content") or "") + "".join(
                        f"<tool_call>{json.dumps(p)}</tool_call>" for p in parsed)
            out.append(m)
        return out

    def render(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]]) -> str:
        return self.turns._render(self.template_messages(messages), True, tools or None)

    def encode(self, text: str) -> list[int]:
        return self.turns.encode(text)

    def token_text(self, token: int) -> str:
        return self.turns._text_of(token)


def _loads(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def same_reply(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """Is the assistant message an agent sent back the one the gateway returned (content, and the
    tool calls by name and parsed arguments; ids and None-vs-empty content do not matter)?"""
    if sent.get("role") != "assistant":
        return False
    if (sent.get("content") or "") != (returned.get("content") or ""):
        return False
    calls = [(c["function"]["name"], _loads(c["function"]["arguments"])) for c in sent.get("tool_calls") or []]
    want = [(c["function"]["name"], _loads(c["function"]["arguments"])) for c in returned.get("tool_calls") or []]
    return calls == want


@dataclass
class Segment:
    """One trained sequence: the first call's prompt, then every later token -- sampled (mask 1,
    with its logprob) or template/tool text (mask 0, logprob 0) -- and the state of its last call."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    finish_reason: str = "stop"
    text: str = ""                       # the last call's decoded output (what a reward function scores)
    tool_calls: int = 0
    tool_errors: int = 0
    busy: bool = False                   # a call on it is in flight
    # the last call, to match the next one against
    last_kind: str = "chat"
    last_messages: list[dict[str, Any]] = field(default_factory=list)
    last_tools: Any = None
    last_prompt_text: str = ""
    last_reply: dict[str, Any] = field(default_factory=dict)    # chat: the assistant message returned
    last_output: list[int] = field(default_factory=list)
    serial: int = 0                      # order of the last call over the trajectory

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def template_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)


@dataclass
class Plan:
    """Where one call goes: a segment (new or open) and the ids it adds before the generation."""

    segment: Segment
    tail: list[int]                  # ids appended before the sampled ones (open segment) -- mask 0
    new: bool
    how: str                         # new | extends | splice

    @property
    def prompt_ids(self) -> list[int]:
        return self.segment.context + self.tail if not self.new else list(self.segment.prompt_ids)


class CallTrajectory:
    """The segments of one trajectory (module doc). Not thread-safe: the gateway's event loop owns it."""

    def __init__(self, render: ChatRender, keep_versions: bool = False):
        self.render = render
        self.keep_versions = keep_versions
        self.segments: list[Segment] = []
        self.calls = 0

    # ------------------------------------------------------------------ planning
    def plan_chat(self, messages: list[dict[str, Any]], tools: Any) -> tuple[Plan, str]:
        """The plan of a chat call and its rendered prompt text."""
        text = self.render.render(messages, tools)
        ids = self.render.encode(text)
        for seg in self._open("chat"):
            ctx = seg.context
            if len(ids) > len(ctx) and ids[:len(ctx)] == ctx:
                return Plan(seg, ids[len(ctx):], False, "extends"), text
            tail = self._splice(seg, messages, tools)
            if tail is not None:
                return Plan(seg, tail, False, "splice"), text
        return Plan(Segment(ids, last_kind="chat"), [], True, "new"), text

    def plan_text(self, prompt: str) -> Plan:
        ids = [int(t) for t in self.render.tok.encode(prompt)]
        for seg in self._open("text"):
            ctx = seg.context
            if len(ids) > len(ctx) and ids[:len(ctx)] == ctx:
                return Plan(seg, ids[len(ctx):], False, "extends")
            done = seg.last_prompt_text + seg.last_reply.get("text", "")
            if len(prompt) > len(done) and prompt.startswith(done):
                return Plan(seg, self.render.encode(prompt[len(done):]), False, "splice")
        return Plan(Segment(ids, last_kind="text"), [], True, "new")

    def _open(self, kind: str) -> list[Segment]:
        """Segments a call may continue: not busy, of the same API, most recently used first."""
        return sorted((s for s in self.segments if not s.busy and s.last_kind == kind and s.calls),
                      key=lambda s: -s.serial)

    def _splice(self, seg: Segment, messages: list[dict[str, Any]], tools: Any) -> Optional[list[int]]:
        k = len(seg.last_messages)
        if len(messages) <= k + 1 or messages[:k] != seg.last_messages or tools != seg.last_tools:
            return None
        if not same_reply(messages[k], seg.last_reply):
            return None
        probe = messages[:k] + [{"role": "assistant", "content": SENTINEL}] + messages[k + 1:]
        text = self.render.render(probe, tools)
        at = text.find(SENTINEL)
        if at < 0 or text[:at] != seg.last_prompt_text:
            return None       # the template renders the earlier turns otherwise now: not a continuation
        tail = text[at + len(SENTINEL):]
        if seg.finish_reason == "stop" and seg.last_output:
            last = self.render.token_text(seg.last_output[-1])
            if last and tail.startswith(last):      # the model's own end-of-turn token: not added twice
                tail = tail[len(last):]
        return self.render.encode(tail)

    # ------------------------------------------------------------------ bookkeeping
    def begin(self, plan: Plan) -> None:
        plan.segment.busy = True
        if plan.new:
            self.segments.append(plan.segment)

    def abandon(self, plan: Plan) -> None:
        """The call produced nothing (cut): an open segment stays as it was, a new one is dropped."""
        plan.segment.busy = False
        if plan.new and not plan.segment.calls and plan.segment in self.segments:
            self.segments.remove(plan.segment)

    def record(self, plan: Plan, output_ids: list[int], logprobs: list[float], versions: list[int],
               finish_reason: str, text: str) -> None:
        """A finished call: the tail (mask 0), then the sampled ids exactly as the server returned them."""
        seg = plan.segment
        if len(logprobs) != len(output_ids):
            raise ValueError(f"a call has {len(output_ids)} sampled ids but {len(logprobs)} logprobs")
        if plan.tail:
            seg.ids += plan.tail
            seg.logprobs += [0.0] * len(plan.tail)
            seg.mask += [0] * len(plan.tail)
            if self.keep_versions:
                seg.versions += [seg.versions[-1] if seg.versions else (versions[0] if versions else 0)] * len(plan.tail)
        seg.ids += output_ids
        seg.logprobs += logprobs
        seg.mask += [1] * len(output_ids)
        if self.keep_versions:
            seg.versions += versions
        self.calls += 1
        seg.calls += 1
        seg.serial = self.calls
        seg.finish_reason, seg.text, seg.last_output = finish_reason, text, list(output_ids)
        seg.busy = False

    def remember_chat(self, plan: Plan, messages: list[dict[str, Any]], tools: Any, prompt_text: str,
                      reply: dict[str, Any]) -> None:
        seg = plan.segment
        seg.last_kind, seg.last_messages, seg.last_tools = "chat", messages, tools
        seg.last_prompt_text, seg.last_reply = prompt_text, reply

    def remember_text(self, plan: Plan, prompt: str, text: str) -> None:
        seg = plan.segment
        seg.last_kind, seg.last_prompt_text, seg.last_reply = "text", prompt, {"text": text}

    def trained(self, which: str) -> list[Segment]:
        """The segments that become samples (``agent.segments``: all | last), in creation order."""
        done = [s for s in self.segments if s.calls]
        if which == "last" and done:
            return [max(done, key=lambda s: s.serial)]
        return done
