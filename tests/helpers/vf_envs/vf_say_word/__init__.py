"""A tiny verifiers (v1) environment written only against verifiers' public API, for megarl's hub tests.

It stands in for an environment installed from a hub (a package exporting its ``Taskset`` and
``Harness`` via ``__all__``, imported by its id ``vf-say-word``): the tests put this folder on
``sys.path`` as ``pip install`` would. Everything runs offline: the dataset is built in code and
the harness is an in-process chat loop (verifiers' built-in ``bash``/``null`` harnesses install
their program with ``uv``, which needs the network).

The task: "Reply with the word X." -- a reply containing X scores 1 (``said_word``), so even
SmolLM2-135M-Instruct earns a reward now and then; otherwise the share of X's letters the reply
holds, halved (a lenient grader: a random model's replies differ in reward within a group). A reply
containing ``BOOM`` makes the reward function raise: the failure path (an episode that errors
inside verifiers) on demand.
"""
from __future__ import annotations

from openai import AsyncOpenAI

import verifiers.v1 as vf

WORDS = ("yes", "hello", "blue", "seven", "cat", "apple", "green", "water", "sun", "tree", "red", "one")
SENTINEL = "BOOM"


class SayWordConfig(vf.TasksetConfig):
    """``num_tasks``: how many tasks ``load`` yields (cycling through WORDS)."""

    num_tasks: int = 8


class SayWordData(vf.TaskData):
    word: str
    """The word the reply must contain."""


class SayWordTask(vf.Task[SayWordData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def said_word(self, task: SayWordData, trace: vf.Trace) -> float:
        """1 if the reply contains the word (case-insensitive), else half the share of its letters
        the reply holds; raises on the sentinel."""
        reply = trace.last_reply
        if SENTINEL in reply:
            raise ValueError(f"the reply contains {SENTINEL}")
        word, text = task.word.lower(), reply.lower()
        if word in text:
            return 1.0
        letters = set(word)
        return 0.5 * len(letters & set(text)) / len(letters)


class SayWordTaskset(vf.Taskset[SayWordTask, SayWordConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            word = WORDS[i % len(WORDS)]
            yield SayWordTask(SayWordData(id=f"say-{i}", name=f"say {word}", word=word,
                                          prompt=f"Reply with the word {word}.",
                                          system_prompt="You are a helpful assistant."),
                              self.config.task)


class ChatOnceConfig(vf.HarnessConfig):
    """``max_tokens``: the reply's token cap sent with the call."""

    max_tokens: int = 16


class ChatOnceHarness(vf.Harness[ChatOnceConfig]):
    """One chat completion through the rollout's interception endpoint, run in-process (the
    harness contract allows a loop in-process as long as every model call goes through
    ``endpoint`` + ``secret``)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(exclude_none=True) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages,
                                                 max_tokens=self.config.max_tokens)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["SayWordTaskset", "ChatOnceHarness"]
