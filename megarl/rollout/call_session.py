"""One trajectory's API calls, as the gateway serves them: plan the prompt ids (no re-tokenization,
``call_trajectory.py``), generate through megarl's rollout client, record, answer in OpenAI's shape.

Generation goes through the run's ``RolloutManager`` like the built-in agent loop's turns: least
loaded server, retries on another server, healing. Off-policy runs continue a request that a
weight update aborted (``partial.generate_resumable``, per-token weight versions); a sync run never
pauses mid-batch, so an abort there cannot be continued and cuts the call.

A call that cannot be answered gets an OpenAI error the ``openai`` package raises, never a hang:

* limits the model ran into (``agent.max_turns`` calls, ``agent.max_response_tokens`` per segment,
  ``rollout.max_prompt_len`` for a new segment's prompt): 400 ``context_length_exceeded`` -- the
  trajectory is *truncated* (the model's doing: it is still scored);
* the trajectory's deadline (``agent.trajectory_timeout_s``) or its end: 408 ``trajectory_closed``;
* servers gone, a request that kept failing, an abort a sync run cannot continue: 503
  ``rollout_unavailable`` -- the call is *cut* (infrastructure: nothing of it is recorded).
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megarl.rollout.call_trajectory import CallTrajectory, ChatRender, Plan
from megarl.rollout.client import GenerateOutput, RequestFailed
from megarl.rollout.openai_wire import (CompletionRequest, WireError, chat_completion, finish_reason,
                                        openai_tool_calls, text_completion)
from megarl.rollout.partial import generate_resumable

TURN_SEED_STRIDE = 1_000_003   # as the built-in loop: call k of a trajectory samples with seed + k * stride


@dataclass
class CallLimits:
    max_turns: int = 8                   # calls per trajectory
    max_response_tokens: int = 1024      # per segment: tokens after its first prompt
    max_new_tokens: int = 256            # per call (rollout.sampling.max_new_tokens)
    max_prompt_len: int = 0              # a new segment's prompt (0: unchecked)


@dataclass
class Sent:
    """What one call sampled."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str


class CallSession:
    """The calls of one trajectory (one API key)."""

    def __init__(self, manager: Any, render: ChatRender, parse: Callable, sampling: dict[str, Any],
                 limits: CallLimits, seed: Optional[int], job_index: int, keep_versions: bool, model: str,
                 deadline: float):
        self.manager, self.render, self.parse = manager, render, parse
        self.sampling, self.limits, self.seed, self.job_index = dict(sampling), limits, seed, job_index
        self.keep_versions, self.model, self.deadline = keep_versions, model, deadline
        self.trajectory = CallTrajectory(render, keep_versions)
        self.truncated = ""              # a limit the model ran into
        self.cut = ""                    # the last infrastructure error a call got
        self.closed: Optional[str] = None
        self.key = ""                    # the API key the gateway gave it
        self.resumed = 0                 # answers continued after an abort (off-policy runs)
        self._closing = asyncio.Event()
        # per recorded call: (input ids, sampled ids, logprobs) as sent to / answered by the server, and
        # how its prompt was joined (new | extends | splice) -- tests and debugging read them
        self.server_ids: list[tuple[list[int], list[int], list[float]]] = []
        self.joins: list[str] = []

    # ------------------------------------------------------------------ life
    def close(self, why: str) -> None:
        """No more calls: the agent returned, failed or ran past the deadline. Calls in flight end with 408."""
        if self.closed is None:
            self.closed = why
            self._closing.set()

    def _check_open(self) -> None:
        if self.closed is not None:
            raise WireError(408, f"this trajectory is over ({self.closed}); no more calls are served for its key",
                            "timeout", "trajectory_closed")

    # ------------------------------------------------------------------ calls
    async def chat(self, req: CompletionRequest) -> dict[str, Any]:
        self._check_open()
        plan, prompt_text = self.trajectory.plan_chat(req.messages, req.tools)
        sent, text = await self._run(plan, req.max_tokens)
        calls, errors = self.parse(text)
        tool_calls = openai_tool_calls(calls)
        content = _without_calls(text) if calls else text
        reply = {"role": "assistant", "content": content or None}
        if tool_calls:
            reply["tool_calls"] = tool_calls
        self.trajectory.remember_chat(plan, req.messages, req.tools, prompt_text, reply)
        seg = plan.segment
        seg.tool_calls += len(calls)
        seg.tool_errors += len(errors)
        return chat_completion(req.model or self.model, reply["content"], tool_calls,
                               finish_reason(sent.finish_reason, bool(tool_calls)), len(plan.prompt_ids),
                               len(sent.output_ids))

    async def complete(self, req: CompletionRequest) -> dict[str, Any]:
        self._check_open()
        plan = self.trajectory.plan_text(req.prompt)
        sent, text = await self._run(plan, req.max_tokens)
        self.trajectory.remember_text(plan, req.prompt, text)
        return text_completion(req.model or self.model, text, finish_reason(sent.finish_reason, False),
                               len(plan.prompt_ids), len(sent.output_ids))

    async def _run(self, plan: Plan, max_tokens: Optional[int]) -> tuple[Sent, str]:
        """Limits, generation under the deadline, recording. Returns what was sampled and its text."""
        lim = self.limits
        prompt = plan.prompt_ids
        if self.trajectory.calls >= lim.max_turns:
            self._truncate("max_turns", f"this trajectory made its {lim.max_turns} calls (agent.max_turns)")
        if plan.new and lim.max_prompt_len and len(prompt) > lim.max_prompt_len:
            self._truncate("prompt_length", f"the prompt is {len(prompt)} tokens, more than rollout.max_prompt_len "
                           f"{lim.max_prompt_len}")
        budget = lim.max_response_tokens - (len(prompt) - len(plan.segment.prompt_ids))
        if budget <= 0:
            self._truncate("token_budget", f"this conversation used its {lim.max_response_tokens} tokens after the "
                           f"first prompt (agent.max_response_tokens)")
        new_tokens = min(lim.max_new_tokens, budget, max_tokens or lim.max_new_tokens)
        self.trajectory.begin(plan)
        recorded = False
        try:
            sent = await self._generate_until_closed(prompt, new_tokens)
            text = self.render.tok.decode(sent.output_ids, skip_special_tokens=True)
            self.trajectory.record(plan, sent.output_ids, sent.logprobs, sent.versions, sent.finish_reason, text)
            recorded = True
        finally:
            if not recorded:        # cut, refused, cancelled: nothing of the call enters the trajectory
                self.trajectory.abandon(plan)
        self.server_ids.append((list(prompt), list(sent.output_ids), list(sent.logprobs)))
        self.joins.append(plan.how)
        if sent.finish_reason == "length" and not self.truncated and budget <= new_tokens:
            self.truncated = "token_budget"
        return sent, text

    async def _generate_until_closed(self, prompt: list[int], new_tokens: int) -> Sent:
        """One generation, ended early (408) when the trajectory closes or its deadline passes;
        server failures become 400 (refused) or 503 (cut)."""
        seed = None if self.seed is None else (self.seed + self.trajectory.calls * TURN_SEED_STRIDE) & 0x7FFFFFFF
        task = asyncio.ensure_future(self._generate(prompt, dict(self.sampling, max_new_tokens=new_tokens), seed))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            remaining = self.deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait({task, closing}, timeout=max(remaining, 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                self.close(self.closed or "its deadline, agent.trajectory_timeout_s, passed")
                self._check_open()
            return task.result()
        except RequestFailed as err:
            if err.status < 500:       # the server refused the request itself (e.g. longer than its context)
                raise WireError(400, f"the rollout server refused the call: {err.message}", code="server_refused") from err
            self.cut = str(err)
            raise WireError(503, f"the rollout server failed: {err}", "server_error", "rollout_unavailable") from err
        except (WireError, asyncio.CancelledError):
            raise
        except Exception as err:  # noqa: BLE001 - no server left, a request that kept failing: cut, not hung
            self.cut = f"{type(err).__name__}: {err}"
            raise WireError(503, f"the call could not be generated: {self.cut}", "server_error",
                            "rollout_unavailable") from err
        finally:
            closing.cancel()
            if not task.done():
                task.cancel()

    def _truncate(self, why: str, message: str) -> None:
        self.truncated = self.truncated or why
        raise WireError(400, f"{message}: the trajectory is truncated", code="context_length_exceeded")

    async def _generate(self, ids: list[int], params: dict[str, Any], seed: Optional[int]) -> Sent:
        send = functools.partial(self.manager.generate_one, job_index=self.job_index)
        if self.keep_versions:
            t = await generate_resumable(send, ids, params, seed)
            self.resumed += t.resumed
            return Sent(t.output_ids, t.logprobs, t.versions, t.finish_reason)
        if seed is not None:
            params = dict(params, sampling_seed=seed)
        out: GenerateOutput = await send(ids, params)
        if out.finish_reason == "abort":
            raise RuntimeError("the generation was aborted (a weight update or a server stop) and rollout.mode "
                               "sync does not continue aborted requests")
        if out.logprobs is None or len(out.logprobs) != len(out.output_ids):
            raise RuntimeError(f"a /generate answer has {len(out.output_ids)} tokens but "
                               f"{'no' if out.logprobs is None else len(out.logprobs)} logprobs")
        return Sent([int(t) for t in out.output_ids], [float(x) for x in out.logprobs], [], out.finish_reason)


def _without_calls(text: str) -> str:
    """The text of a turn outside its ``<tool_call>`` blocks (OpenAI's ``content`` beside ``tool_calls``)."""
    import re

    return re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip()
