"""Token-in-token-out trajectories: the model's tokens as the server returned them, interleaved
with tokenised environment text, and the loss mask that tells them apart.

Only the environment's part of a conversation is ever tokenised here. What that part looks like
in tokens is the chat template's business (turn boundaries, role headers, ``<tool_response>``
wrappers...), so it is read off the template itself: the template renders a fixed two-message
conversation ending in an assistant turn whose content is a sentinel, followed by the
observation messages and the generation prompt; everything after the sentinel is the
environment's text -- the end of the assistant turn, the observation turns, the header of the
next assistant turn. When the model's turn already ended with the template's end-of-turn token
(it stopped on it), that token is the model's own and is not added twice.

The model's decoded text is never encoded back into the trajectory: decode -> encode is not the
identity (merges, whitespace, special tokens), and training on tokens the model did not sample
is the token drift the agentic RL literature keeps reporting.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

SENTINEL = "\x00MEGARL-ASSISTANT-TURN\x00"


@dataclass
class TrajectoryBuilder:
    """The response side of one trajectory: token ids, rollout logprobs, loss mask, versions."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add_model(self, ids: list[int], logprobs: list[float], versions: Optional[list[int]] = None) -> None:
        if len(logprobs) != len(ids):
            raise ValueError(f"a model turn has {len(ids)} tokens but {len(logprobs)} logprobs")
        self.ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.mask.extend([1] * len(ids))
        if versions:
            self.versions.extend(versions)

    def add_env(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self.logprobs.extend([0.0] * len(ids))
        self.mask.extend([0] * len(ids))
        if self.versions:   # environment tokens carry the version of the turn they answer (staleness is per sample)
            self.versions.extend([self.versions[-1]] * len(ids))

    def __len__(self) -> int:
        return len(self.ids)


class ChatTurns:
    """Prompt and observation tokens of a conversation through the tokenizer's own chat template."""

    def __init__(self, tokenizer: Any, template_kwargs: Optional[dict[str, Any]] = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("agent.enabled needs a tokenizer with a chat template (turn boundaries come from it)")
        self.tok = tokenizer
        self.kwargs = dict(template_kwargs or {})
        self._head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": SENTINEL}]
        probe = self._render(self._head, add_generation_prompt=False)
        if SENTINEL not in probe:
            raise ValueError("the chat template does not render assistant content verbatim; agent turns need it")
        self._token_text = {}

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: Any = None) -> str:
        return self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                            tokenize=False, **self.kwargs)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """The opening conversation, ending where the assistant's first turn starts."""
        text = self._render(messages, True, tools or None)
        return self.encode(text)

    def observation_text(self, observations: list[dict[str, Any]], model_last_token: Optional[int]) -> str:
        """The text between the model's last token and its next turn (see the module docstring)."""
        text = self._render(self._head + list(observations), add_generation_prompt=True)
        env = text[text.rindex(SENTINEL) + len(SENTINEL):]
        if model_last_token is not None:
            last = self._text_of(model_last_token)
            if last and env.startswith(last):
                env = env[len(last):]
        return env

    def observation_ids(self, observations: list[dict[str, Any]], model_last_token: Optional[int]) -> list[int]:
        return self.encode(self.observation_text(observations, model_last_token))

    def encode(self, text: str) -> list[int]:
        """Environment text -> ids; special tokens in it (role markers) become their own ids."""
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False)]

    def _text_of(self, token: int) -> str:
        if token not in self._token_text:
            self._token_text[token] = self.tok.decode([token], skip_special_tokens=False)
        return self._token_text[token]
