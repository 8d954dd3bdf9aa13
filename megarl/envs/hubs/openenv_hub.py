"""OpenEnv environments trained as they are published: ``agent.entrypoint: megarl.envs.hubs.openenv_hub:run``.

An OpenEnv environment is a server (openenv-core's FastAPI app around an ``Environment`` with
``reset()`` / ``step(action)``) reached by a client over a WebSocket, one server-side environment
instance per connection. This adapter is the agent between that server and megarl's gateway: it
opens an episode of its own (its own WebSocket session, so concurrent trajectories never share an
environment instance), resets it with the record's seed, and loops -- the observation becomes a
user message, the model's reply (a real ``openai`` chat call on the trajectory's key, so megarl
records every token) becomes the environment's action, the environment steps -- until the episode
is done or ``max_steps``. It returns the environment's own rewards (their sum, or the last one).

Why the generic dict client (``openenv.core.GenericEnvClient``) and not the environment's typed
client: the published server is the contract, the typed client is a convenience that would have to
be installed next to the trainer. The action's shape is read from the server's ``/schema`` instead.

Nothing here hides a failure as a reward: an unreachable server, a server-side error, an
observation that is not a JSON object or a reward that is not a number raise, and megarl turns the
exception into a failed sample (never a 0). Only a reply the model wrote that cannot be an action
(``action_format: json``) is the model's doing and gets ``invalid_action_reward``.

openenv-core is an optional extra: it is imported inside the functions that need it.
"""
from __future__ import annotations

import atexit
import importlib
import json
import socket
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

DEFAULT_PROMPT = ""         # exported records carry no instruction of their own: the observation is the task
RECORD_KEY = "openenv"      # record.metadata[RECORD_KEY] = {"seed": int, "reset": {...}}: the episode to play
FIELD = "agent.entrypoint_args"


class OpenEnvError(RuntimeError):
    """The environment side failed (server unreachable, server error, malformed observation): the sample fails."""


# ---------------------------------------------------------------------------------------------- the episode
def run(base_url: str, api_key: str, record: dict[str, Any], *, env_url: Optional[str] = None,
        environment: Optional[str] = None, action_field: Optional[str] = None, action_format: str = "text",
        observation_field: Optional[str] = None, system_prompt: Optional[str] = None, reward: str = "sum",
        max_steps: int = 8, max_tokens: Optional[int] = None, model: Optional[str] = None,
        max_sessions: int = 64, session_wait_s: float = 120.0, message_timeout_s: float = 60.0,
        invalid_action_reward: float = 0.0) -> Optional[float]:
    """Play one episode of the OpenEnv environment against the gateway; the environment's reward.

    ``env_url``: a running OpenEnv server (``http://host:port``, as ``openenv serve`` / a Docker image /
    a Hugging Face Space publishes it). ``environment``: instead, an ``Environment`` subclass as
    ``package.module:Class`` that this process serves with openenv's own server app on 127.0.0.1
    (one server per class and process, ``max_sessions`` sessions if the class declares
    ``SUPPORTS_CONCURRENT_SESSIONS``, else one at a time).

    ``reward``: ``sum`` of the steps' rewards (``None`` counts 0) or ``final`` (the last step's). If no
    step gave a reward at all the result is None, so megarl's ``reward.*`` scores the last reply.
    ``action_format``: ``text`` puts the reply into the action's one text field (``action_field`` when
    it has several), ``json`` reads the reply as the action's JSON object. A server that is full
    (``CAPACITY_REACHED``) is retried for ``session_wait_s`` before the trajectory fails.
    """
    _check_args(env_url, environment, action_format, reward, max_steps)
    url = env_url if env_url is not None else _local_server(environment, max_sessions)
    where = "env_url" if env_url is not None else "environment"
    shape = _action_shape(url, where, action_field, action_format)

    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key)
    model = model or client.models.list().data[0].id
    env, first = _open_episode(url, where, _reset_args(record), session_wait_s, message_timeout_s)
    try:
        if first.done:
            raise OpenEnvError(f"OpenEnv environment at {url}: the episode is done at reset (seed/reset arguments "
                               f"{_reset_args(record)})")
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        prompt = record.get("prompt")
        text = _render(first.observation, observation_field)
        if isinstance(prompt, str) and prompt.strip():
            text = f"{prompt.strip()}\n\n{text}"
        messages.append({"role": "user", "content": text})
        rewards: list[Optional[float]] = []
        for _ in range(max_steps):
            kw = {"max_tokens": max_tokens} if max_tokens is not None else {}
            reply = client.chat.completions.create(model=model, messages=messages, **kw).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            action = shape.action(reply.content or "")
            if action is None:                     # json format, a reply that is no action: the model's doing
                rewards.append(float(invalid_action_reward))
                break
            result = _step(env, action, url)
            rewards.append(_reward_of(result.reward, url))
            if result.done:
                break
            messages.append({"role": "user", "content": _render(result.observation, observation_field)})
    finally:
        _close(env)
    given = [r for r in rewards if r is not None]
    if not given:
        return None
    return float(sum(given)) if reward == "sum" else float(rewards[-1] if rewards[-1] is not None else given[-1])


def _check_args(env_url: Optional[str], environment: Optional[str], action_format: str, reward: str,
                max_steps: int) -> None:
    """One-line errors naming the field: the first trajectory says what is wrong, not a traceback."""
    if (env_url is None) == (environment is None):
        raise ValueError(f"{FIELD}: give env_url (a running OpenEnv server) or environment (package.module:Class), "
                         f"exactly one")
    if env_url is not None and (not isinstance(env_url, str) or "://" not in env_url):
        raise ValueError(f"{FIELD}.env_url: {env_url!r} must be a URL such as http://127.0.0.1:8000")
    if action_format not in ("text", "json"):
        raise ValueError(f"{FIELD}.action_format: {action_format!r} must be text or json")
    if reward not in ("sum", "final"):
        raise ValueError(f"{FIELD}.reward: {reward!r} must be sum or final")
    if not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"{FIELD}.max_steps: {max_steps!r} must be a positive integer")


def _reset_args(record: dict[str, Any]) -> dict[str, Any]:
    """``reset(seed=..., **reset)`` from ``record.metadata.openenv`` (what :func:`export_records` writes)."""
    meta = record.get("metadata") or {}
    spec = meta.get(RECORD_KEY) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"record metadata.{RECORD_KEY}: expected an object with seed / reset, got {spec!r}")
    args = dict(spec.get("reset") or {})
    if spec.get("seed") is not None:
        args["seed"] = int(spec["seed"])
    return args


def _render(observation: Any, field: Optional[str]) -> str:
    """The observation as a user message: ``field`` when named, the one text field of a one-field
    observation, else the whole observation as JSON (sorted keys, so equal observations render equally)."""
    if not isinstance(observation, dict):
        raise OpenEnvError(f"OpenEnv observation: expected a JSON object, got {type(observation).__name__}")
    if field is not None:
        if field not in observation:
            raise OpenEnvError(f"{FIELD}.observation_field: {field!r} is not in the observation "
                               f"(fields: {sorted(observation)})")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    if len(observation) == 1:
        (value,) = observation.values()
        if isinstance(value, str):
            return value
    return json.dumps(observation, sort_keys=True)


def _reward_of(value: Any, url: str) -> Optional[float]:
    """A step's reward as a float; None stays None (no reward this step); anything else is malformed."""
    if value is None:
        return None
    if not isinstance(value, (bool, int, float)):
        raise OpenEnvError(f"OpenEnv environment at {url}: reward {value!r} is not a number")
    return float(value)


# ---------------------------------------------------------------------------------------------- actions
@dataclass
class ActionShape:
    """How a reply becomes the environment's action: one text field, or the reply as the JSON object."""

    text_field: Optional[str]          # text format: the field the reply fills
    fields: tuple[str, ...]            # the action's fields (without openenv's own ``metadata``)
    required: tuple[str, ...]

    def action(self, reply: str) -> Optional[dict[str, Any]]:
        """The action dict, or None when a JSON reply is not an object of the action's fields."""
        if self.text_field is not None:
            return {self.text_field: reply}
        body = reply.strip()
        if body.startswith("```"):
            body = body.strip("`")
            body = body[4:] if body.startswith("json") else body
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not set(value) <= set(self.fields) or not set(self.required) <= set(value):
            return None
        return value


_SHAPES: dict[str, dict[str, Any]] = {}
_SHAPES_LOCK = threading.Lock()


def _action_shape(url: str, where: str, action_field: Optional[str], action_format: str) -> ActionShape:
    """The action's fields from the server's ``/schema`` (fetched once per URL and process)."""
    with _SHAPES_LOCK:
        schema = _SHAPES.get(url)
    if schema is None:
        import httpx

        http = "http" + url[2:] if url.startswith("ws") else url
        try:
            resp = httpx.get(http.rstrip("/") + "/schema", timeout=10.0)
            resp.raise_for_status()
            schema = resp.json()["action"]
        except Exception as e:  # noqa: BLE001 - any failure here means the server is not reachable as OpenEnv
            raise OpenEnvError(f"{FIELD}.{where}: cannot reach an OpenEnv server at {url} "
                               f"({type(e).__name__}: {' '.join(str(e).split())})") from None
        with _SHAPES_LOCK:
            _SHAPES[url] = schema
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    required = tuple(k for k in schema.get("required") or () if k != "metadata")
    fields = tuple(props)
    if action_format == "json":
        return ActionShape(None, fields, required)
    if action_field is not None:
        if action_field not in props:
            raise ValueError(f"{FIELD}.action_field: {action_field!r} is not a field of the action ({list(fields)})")
        field = action_field
    elif len(props) == 1:
        (field,) = props
    else:
        texts = [k for k, v in props.items() if v.get("type") == "string"]
        if len(texts) != 1:
            raise ValueError(f"{FIELD}.action_field: the action has fields {list(fields)}; name the one the "
                             f"model's reply fills, or use action_format: json")
        field = texts[0]
    others = [k for k in required if k != field]
    if others:
        raise ValueError(f"{FIELD}.action_format: the action also requires {others}, which a text reply cannot "
                         f"fill; use action_format: json")
    return ActionShape(field, fields, required)


# ---------------------------------------------------------------------------------------------- sessions
def _open_episode(url: str, where: str, reset: dict[str, Any], wait_s: float,
                  message_timeout_s: float) -> tuple[Any, Any]:
    """A WebSocket session of its own (one server-side environment instance) and its reset result.
    A full server (``CAPACITY_REACHED``: more trajectories than its ``max_concurrent_envs``) is asked
    again with back-off until ``wait_s``; anything else raises at once."""
    from openenv.core import GenericEnvClient
    from websockets.exceptions import ConnectionClosed

    deadline = time.monotonic() + wait_s
    pause = 0.05
    while True:
        env = GenericEnvClient(base_url=url, connect_timeout_s=10.0, message_timeout_s=message_timeout_s).sync()
        try:
            env.connect()
        except ConnectionError as e:
            _close(env)
            raise OpenEnvError(f"{FIELD}.{where}: cannot reach {url}: {' '.join(str(e).split())}") from None
        try:
            return env, env.reset(**reset)
        except (RuntimeError, ConnectionClosed) as e:
            _close(env)
            # a full server answers CAPACITY_REACHED and closes; the close can win the race with our
            # reset, so a session closed before its reset is read the same way (until the deadline)
            full = "CAPACITY_REACHED" in str(e) or isinstance(e, ConnectionClosed)
            if full and time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 1.0)
                continue
            why = ("the server closed the session before its reset (all max_concurrent_envs sessions busy for "
                   f"{wait_s:g} s, or its environment factory failed)" if isinstance(e, ConnectionClosed)
                   else f"reset failed: {' '.join(str(e).split())}")
            raise OpenEnvError(f"OpenEnv environment at {url}: {why}") from None
        except Exception:
            _close(env)
            raise


def _step(env: Any, action: dict[str, Any], url: str) -> Any:
    """One step; the server's error (EXECUTION_ERROR, VALIDATION_ERROR, a closed session) in one line."""
    from websockets.exceptions import ConnectionClosed

    try:
        return env.step(action)
    except (RuntimeError, ConnectionClosed) as e:
        raise OpenEnvError(f"OpenEnv environment at {url}: step failed: {type(e).__name__}: "
                           f"{' '.join(str(e).split())}") from None


def _close(env: Any) -> None:
    try:
        env.close()
    except Exception:  # noqa: BLE001 - teardown of a session that already failed: nothing more to report
        pass


# ---------------------------------------------------------------------------------------------- in-process server
_SERVERS: dict[tuple[str, int], tuple[str, Any, threading.Thread]] = {}
_SERVERS_LOCK = threading.Lock()


def _env_types(cls: type) -> tuple[type, type]:
    """The Action and Observation classes of an Environment subclass, from ``step``/``reset``
    annotations or its ``Environment[Act, Obs, State]`` base (openenv's app needs both)."""
    from openenv.core import Action, Observation

    def is_sub(t: Any, base: type) -> bool:
        return isinstance(t, type) and issubclass(t, base)
    act = obs = None
    try:
        act = typing.get_type_hints(cls.step).get("action")
        obs = typing.get_type_hints(cls.reset).get("return")
    except Exception:  # noqa: BLE001 - unresolvable annotations: the generic base may still say
        pass
    for base in getattr(cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if len(args) >= 2:
            act = act if is_sub(act, Action) else args[0]
            obs = obs if is_sub(obs, Observation) else args[1]
    if not (is_sub(act, Action) and is_sub(obs, Observation)):
        raise ValueError(f"{FIELD}.environment: cannot tell {cls.__name__}'s Action and Observation classes from "
                         f"its step()/reset() annotations or its Environment[...] base")
    return act, obs


def _local_server(spec: Optional[str], max_sessions: int) -> str:
    """``package.module:Class`` served by openenv's own app (uvicorn, 127.0.0.1, a port bound before
    the server starts) for the rest of the process; its URL."""
    assert spec is not None
    with _SERVERS_LOCK:
        key = (spec, max_sessions)
        if key in _SERVERS:
            return _SERVERS[key][0]
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"{FIELD}.environment: {spec!r} must be package.module:Class")
        module, name = spec.rsplit(":", 1)
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001 - any import failure is the field's, in one line
            raise ValueError(f"{FIELD}.environment: cannot import {spec!r}: {type(e).__name__}: "
                             f"{' '.join(str(e).split())}") from None
        from openenv.core import Environment, create_fastapi_app

        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise ValueError(f"{FIELD}.environment: {spec!r} is not an openenv Environment subclass")
        act, obs = _env_types(cls)
        sessions = max_sessions if getattr(cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
        app = create_fastapi_app(cls, act, obs, max_concurrent_envs=sessions)
        url, server, thread = serve_app(app)
        _SERVERS[key] = (url, server, thread)
        return url


def serve_app(app: Any) -> tuple[str, Any, threading.Thread]:
    """Run an ASGI app with uvicorn in a daemon thread on 127.0.0.1 (port bound here, so no race for
    it); (url, server, thread). The server stops at interpreter exit or on ``server.should_exit = True``."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="websockets-sansio", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="openenv-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise OpenEnvError("the in-process OpenEnv server did not start")
        time.sleep(0.02)
    atexit.register(setattr, server, "should_exit", True)
    return f"http://127.0.0.1:{port}", server, thread


# ---------------------------------------------------------------------------------------------- records
_RUN_ARGS = ("env_url", "environment", "action_field", "action_format", "observation_field", "system_prompt",
             "reward", "max_steps", "max_tokens", "model", "max_sessions", "session_wait_s", "message_timeout_s",
             "invalid_action_reward")


def export_records(out: Path, *, count: int, prompt: str = DEFAULT_PROMPT, seed_start: int = 0,
                   reset: Optional[dict[str, Any]] = None, **run_args: Any) -> int:
    """Write ``count`` JSONL rows, one episode each (seeds ``seed_start ..``), that ``data.source:
    jsonl`` reads: ``prompt`` (an instruction put before the first observation; empty: none),
    ``answer`` (null: the environment scores), and ``openenv: {seed, reset}`` (the loader keeps it
    in ``record.metadata``, where :func:`run` reads the episode). ``run_args`` may repeat
    ``agent.entrypoint_args`` (``env_url`` ...) so one argument list serves both; they are not used
    here, since the episodes are made by the server at reset, not listed by it."""
    from megarl.envs.hubs.cli import HubError   # one line from `megarl hub export`, not a traceback

    unknown = sorted(set(run_args) - set(_RUN_ARGS))
    if unknown:
        raise HubError(f"openenv export: unknown arguments {unknown} (known: count, prompt, seed_start, reset, "
                       f"{', '.join(_RUN_ARGS)})")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise HubError(f"openenv export: count {count!r} must be a positive integer")
    if isinstance(seed_start, bool) or not isinstance(seed_start, int) or seed_start < 0:
        raise HubError(f"openenv export: seed_start {seed_start!r} must be an integer >= 0")
    if reset is not None and not isinstance(reset, dict):
        raise HubError(f"openenv export: reset {reset!r} must be a mapping of reset() arguments")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as handle:
        for i in range(count):
            episode = {"seed": seed_start + i, "reset": dict(reset or {})}
            row = {"prompt": str(prompt), "answer": None, RECORD_KEY: episode}
            handle.write(json.dumps(row, sort_keys=True) + "\n")
    return count
