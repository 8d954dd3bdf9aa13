"""A tiny text game written against openenv-core's public API, and openenv's own server for it.

``WordLengthEnv``: each turn the environment asks for a word of some length (drawn from the reset
seed) and rewards the reply by how close its length is, ``1 / (1 + |len - target|)``; the episode
is done after ``TURNS`` steps or on an exact hit. Multi-turn, text observations, a continuous reward
(a random model's replies differ in it, so GRPO has something to learn from).

It is the reference side of the adapter's contract: served by openenv's ``create_fastapi_app``
(uvicorn on 127.0.0.1) and reached by openenv's ``GenericEnvClient``, exactly as a published
environment is. Class attributes let a test make concurrent sessions meet (``barrier``) or make a
step fail on the server (``explode_on``).
"""
from __future__ import annotations

import random
import threading
import uuid
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from openenv.core import Action, Environment, Observation, State, create_fastapi_app

from megarl.envs.hubs.openenv_hub import serve_app

TURNS = 3


class SayAction(Action):
    message: str


class PromptObservation(Observation):
    prompt: str


class WordLengthEnv(Environment[SayAction, PromptObservation, State]):
    """Say a word of N letters, three times (N changes each turn)."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    barrier: Optional[threading.Barrier] = None       # set by a test: every session's reset waits for the others
    explode_on: Optional[str] = None                  # set by a test: a step with this message raises
    instances: list[str] = []                         # episode ids, in reset order (every session's)
    log: dict[str, dict[str, Any]] = {}               # by episode id: seed, the messages stepped, the rewards given

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self._targets: list[int] = []

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> PromptObservation:
        if WordLengthEnv.barrier is not None:
            WordLengthEnv.barrier.wait()
        rng = random.Random(seed)
        self._targets = [rng.randint(2, 9) for _ in range(TURNS)]
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        WordLengthEnv.instances.append(self._state.episode_id)
        WordLengthEnv.log[self._state.episode_id] = {"seed": seed, "messages": [], "rewards": []}
        return PromptObservation(prompt=self._ask())

    def _ask(self) -> str:
        return f"Reply with one word of exactly {self._targets[self._state.step_count]} letters."

    def step(self, action: SayAction, timeout_s: Optional[float] = None, **kwargs: Any) -> PromptObservation:
        if WordLengthEnv.explode_on is not None and action.message == WordLengthEnv.explode_on:
            raise RuntimeError("the environment broke")
        if not self._targets or self._state.step_count >= TURNS:
            raise RuntimeError("step after the episode ended (or before reset)")
        target = self._targets[self._state.step_count]
        reward = 1.0 / (1.0 + abs(len(action.message.strip()) - target))
        self._state.step_count += 1
        entry = WordLengthEnv.log[self._state.episode_id]
        entry["messages"].append(action.message)
        entry["rewards"].append(reward)
        done = self._state.step_count >= TURNS or reward == 1.0
        return PromptObservation(prompt="" if done else self._ask(), reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


def reference_episode(seed: Optional[int], messages: list[str]) -> tuple[list[float], bool]:
    """Step the environment class directly (no server, no client, no adapter): the rewards it gives
    for these messages, and whether it was done after the last one."""
    env = WordLengthEnv()
    env.reset(seed=seed)
    rewards, done = [], False
    for m in messages:
        obs = env.step(SayAction(message=m))
        rewards.append(float(obs.reward))
        done = obs.done
        if done:
            break
    return rewards, done


@contextmanager
def openenv_server(max_sessions: int = 16) -> Iterator[str]:
    """``WordLengthEnv`` served by openenv's own app on 127.0.0.1; its http URL. Stopped on exit."""
    app = create_fastapi_app(WordLengthEnv, SayAction, PromptObservation, max_concurrent_envs=max_sessions)
    url, server, thread = serve_app(app)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=10)
