"""Train a published ``verifiers`` (v1) environment unchanged, through the bring-your-own-agent gateway.

``agent.entrypoint: megarl.envs.hubs.verifiers_hub:run`` with ``agent.entrypoint_args:
{environment: <taskset id>, env_args: {...}}``. megarl calls :func:`run` once per trajectory; it
plays ONE episode of the environment with verifiers' own machinery (``Env.run_episode``: the
environment's harness, runtime, interception server, stop rules and scoring) against megarl's
gateway, and returns the environment's own reward. The gateway records every model call token
for token, so what trains is what the servers sampled.

How the pieces meet:

* ``environment`` is the taskset id verifiers resolves (``vf-eval <id>``: an installed package
  ``<id>`` with ``-`` as ``_``, or a built-in one); ``env_args`` is the rest of verifiers' ``[env]``
  block (``taskset: {...}`` options, ``agent: {harness: ..., runtime: ..., max_turns: ...}``...).
  A seat whose runtime ``env_args`` does not name runs in verifiers' ``subprocess`` runtime
  (verifiers' own default is a remote sandbox, which megarl does not provision).
* The model endpoint is a verifiers ``EvalClientConfig`` at the gateway. verifiers reads an
  endpoint's key from an environment variable when it builds the client, so each trajectory's
  key goes into a variable of its own for the episode (``MEGARL_VF_KEY_<digest>``).
* The episode runs outside ``Env.serving()``: each rollout then brings up and tears down its own
  interception server (verifiers' un-entered path). A shared server would keep one HTTP client
  per trajectory key (its clients are per endpoint config) for the whole run; and each call of
  :func:`run` has its own event loop (a worker thread), which a shared server could not serve.
  Environments that need serving-level resources (taskset-wide tool servers, an ``Env.start``
  hook) are refused with a one-line error.
* Tasks travel in the data: :func:`export_records` writes each task's wire data (``TaskData``)
  under the row's ``verifiers`` key; :func:`run` rebuilds the task from it and checks its key.

An episode that fails (a harness, model-call, scoring or environment error) raises: megarl makes
it a failed sample, never a 0 reward.
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any, Optional

from megarl.envs.hubs.cli import HubError   # bad arguments or records: one line naming the field

FIELD = "agent.entrypoint_args"
ROW_KEY = "verifiers"                     # the JSONL field (record.metadata key) holding the task
MODEL = "megarl-policy"                   # the gateway serves one model under any name

_CACHE: dict[str, Any] = {}
_CACHE_LOCK = threading.Lock()
_LOAD_LOCKS: dict[str, threading.Lock] = {}


def _vf() -> Any:
    """verifiers' v1 API, imported only when an adapter runs (the package is an optional extra)."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise HubError(f"{FIELD}: the verifiers package is not installed "
                                f"(pip install 'megarl[hubs]'): {err}") from None
    return vf


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _env_config_data(environment: Any, env_args: Optional[dict[str, Any]]) -> dict[str, Any]:
    """verifiers' ``[env]`` block: ``env_args`` with the taskset id set to ``environment`` and an
    unpinned seat runtime made local (``subprocess``)."""
    if not isinstance(environment, str) or not environment.strip():
        raise HubError(f"{FIELD}.environment: must name a verifiers environment (taskset id), "
                                f"got {environment!r}")
    if env_args is None:
        env_args = {}
    if not isinstance(env_args, dict):
        raise HubError(f"{FIELD}.env_args: must be a mapping (verifiers' [env] block), "
                                f"got {type(env_args).__name__}")
    data = copy.deepcopy(env_args)
    taskset = data.get("taskset") or {}
    if not isinstance(taskset, dict):
        raise HubError(f"{FIELD}.env_args.taskset: must be a mapping, got {type(taskset).__name__}")
    if taskset.get("id") not in (None, environment):
        raise HubError(f"{FIELD}.env_args.taskset.id: {taskset['id']!r} differs from "
                                f"environment {environment!r}; name it once, as environment")
    data["taskset"] = {**taskset, "id": environment}
    return data


def _load_config(environment: str, env_args: Optional[dict[str, Any]]) -> Any:
    """The validated ``EnvConfig`` (its concrete class), seats without a runtime run locally."""
    vf = _vf()
    data = _env_config_data(environment, env_args)
    try:
        vf.environment_class(environment, data.get("id") or "")
        vf.taskset_config_type(environment)          # raises when the taskset cannot be imported
    except ModuleNotFoundError as err:
        raise HubError(f"{FIELD}.environment: {environment!r}: {_one_line(err)}") from None
    except (TypeError, ValueError, AttributeError) as err:
        raise HubError(f"{FIELD}.environment: {environment!r} is not a verifiers environment: "
                                f"{_one_line(err)}") from None
    try:
        cls = vf.env_config_type(environment, data.get("id") or "")
        for name, field in cls.model_fields.items():
            if isinstance(field.default, vf.AgentConfig) and "runtime" not in field.default.model_fields_set:
                seat = data.get(name)
                if seat is None or (isinstance(seat, dict) and "runtime" not in seat):
                    data[name] = {**(seat or {}), "runtime": {"type": "subprocess"}}
        return vf.resolve_env_config(data)
    except Exception as err:  # noqa: BLE001 - pydantic's multi-line report, said in one line naming the field
        raise HubError(f"{FIELD}.env_args: {_one_line(err)}") from None


class _Loaded:
    """One environment, loaded once per process: verifiers' ``Env`` and its task class.

    ``Env`` holds no per-episode state outside ``serving()``, so concurrent episodes (each on its
    own thread's event loop) share it."""

    def __init__(self, environment: str, env_args: Optional[dict[str, Any]]):
        vf = _vf()
        self.environment = environment
        self.config = _load_config(environment, env_args)
        try:
            self.env = vf.load_environment(self.config)
        except Exception as err:  # noqa: BLE001 - any construction failure is the arguments' problem
            raise HubError(f"{FIELD}: loading verifiers environment {environment!r}: "
                                    f"{type(err).__name__}: {_one_line(err)}") from None
        taskset = self.env.taskset
        if type(taskset).toolsets(taskset.config):
            raise HubError(f"{FIELD}.environment: {environment!r} serves taskset-wide tool servers "
                                    "(Taskset.toolsets), which need Env.serving(); not supported")
        if type(self.env).start is not vf.Env.start or type(self.env).stop is not vf.Env.stop:
            raise HubError(f"{FIELD}.environment: {environment!r} brings up env-level resources "
                                    "(Env.start/stop), which need Env.serving(); not supported")
        self.task_cls = type(taskset).task_type()

    def task(self, wire: dict[str, Any]) -> Any:
        """The task rebuilt from its exported wire data (the taskset's task class and task config)."""
        data = self.task_cls.data_type().model_validate(wire["data"])
        task = self.task_cls(data, self.env.taskset.config.task)
        if wire.get("key") is not None and task.key != wire["key"]:
            raise HubError(f"record.metadata.{ROW_KEY}.key: the rebuilt task's key differs from the "
                                    "exported one (exported with other env_args or another version?)")
        return task


def _cache_key(environment: Any, env_args: Optional[dict[str, Any]]) -> str:
    try:
        return json.dumps([environment, env_args or {}], sort_keys=True, default=repr)
    except (TypeError, ValueError):
        return repr((environment, env_args))


def load(environment: str, env_args: Optional[dict[str, Any]] = None) -> _Loaded:
    """The environment for these arguments, loaded once per process (thread-safe: trajectories start
    many at once; one loads, the others wait for it rather than loading it again)."""
    key = _cache_key(environment, env_args)
    loaded = _CACHE.get(key)
    if loaded is not None:
        return loaded
    with _CACHE_LOCK:
        lock = _LOAD_LOCKS.setdefault(key, threading.Lock())
    with lock:
        loaded = _CACHE.get(key)
        if loaded is None:
            loaded = _Loaded(environment, env_args)
            with _CACHE_LOCK:
                _CACHE[key] = loaded
    return loaded


def _wire(record: Any) -> dict[str, Any]:
    """The exported task of a record (``record["metadata"]["verifiers"]``)."""
    meta = record.get("metadata") if isinstance(record, dict) else None
    wire = meta.get(ROW_KEY) if isinstance(meta, dict) else None
    if not isinstance(wire, dict) or not isinstance(wire.get("data"), dict):
        raise HubError(f"record.metadata.{ROW_KEY}: the record carries no verifiers task; train on "
                                "rows written by export_records (megarl hub export verifiers)")
    return wire


def _episode_reward(episode: Any) -> float:
    """The episode's reward as verifiers scores it: its trainable traces' rewards (one trace in a
    single-agent environment; their mean when an environment plays several trainable seats)."""
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
    if not traces:
        raise RuntimeError("verifiers episode failed: it produced no trace")
    return float(sum(t.reward for t in traces) / len(traces))


def _failure(episode: Any) -> Optional[str]:
    """Why an episode is not a result (None when it is): verifiers' own verdict, ``episode.ok``."""
    if episode.ok:
        return None
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if errors:
        err = errors[-1]
        return f"{err.type}: {_one_line(err.message)[:500]}"
    return "the verifiers episode did not complete"


async def play(loaded: _Loaded, task: Any, base_url: str, api_key: str) -> Any:
    """One episode of ``task`` against ``base_url`` with the trajectory's key: verifiers' Episode."""
    vf = _vf()
    var = "MEGARL_VF_KEY_" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    os.environ[var] = api_key
    try:
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=var)
        ctx = vf.ModelContext(model=MODEL, client=client)
        return await loaded.env.run_episode(task, ctx)
    finally:
        os.environ.pop(var, None)


def run(base_url: str, api_key: str, record: dict[str, Any], *, environment: str,
        env_args: Optional[dict[str, Any]] = None) -> float:
    """``agent.entrypoint``: one episode of the record's task; the environment's reward.

    Raises RuntimeError (verifiers' error in one line) when verifiers says the episode failed (``episode.ok`` false:
    a harness, model-call, scoring or environment error), so megarl fails the sample."""
    loaded = load(environment, env_args)
    task = loaded.task(_wire(record))
    episode = asyncio.run(play(loaded, task, base_url, api_key))
    why = _failure(episode)
    if why is not None:
        raise RuntimeError(f"verifiers episode failed ({environment!r} task {task.data.idx}): {why}")
    return _episode_reward(episode)


def _prompt(data: Any) -> Any:
    """The task's opening as megarl's ``prompt`` (text, or chat messages with the system prompt)."""
    prompt = data.prompt
    if prompt is None:
        prompt = ""
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [m.model_dump(mode="json", exclude_none=True) for m in prompt])
    for m in messages:
        m.setdefault("content", "")
    if data.system_prompt:
        messages.insert(0, {"role": "system", "content": data.system_prompt})
    if len(messages) == 1 and messages[0]["role"] == "user" and isinstance(messages[0]["content"], str):
        return messages[0]["content"]
    return messages


def export_records(out: Path, *, environment: str, env_args: Optional[dict[str, Any]] = None,
                   split: str = "train", limit: Optional[int] = None) -> int:
    """Write the environment's tasks (its taskset, in ``load()`` order) to ``out`` as megarl JSONL rows
    -- ``prompt``, ``answer`` (the task's ``answer`` field if it has one) and ``verifiers``: the
    environment, the task's index, key and wire data, from which :func:`run` rebuilds it. Returns the
    number of rows. verifiers tasksets have no splits: ``split`` must be ``train``; an eval set is a
    taskset option (``env_args.taskset``) of the environments that offer one. An infinite taskset
    needs ``limit``."""
    if split != "train":
        raise HubError(f"split: verifiers tasksets have no splits (got {split!r}); pass the "
                                "environment's own option in env_args.taskset for another split")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise HubError(f"limit: must be a positive integer, got {limit!r}")
    loaded = load(environment, env_args)
    taskset = loaded.env.taskset
    if limit is not None:
        taskset = taskset.take(limit)
    elif not taskset.bounded:
        raise HubError(f"limit: {environment!r} yields tasks forever; pass a limit")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as handle:
        for task in taskset:
            data = task.data.model_dump(mode="json", exclude_none=True)
            row = {"prompt": _prompt(task.data), "answer": data.get("answer"),
                   ROW_KEY: {"environment": environment, "idx": task.data.idx, "key": task.key, "data": data}}
            handle.write(json.dumps(row) + "\n")
            n += 1
    tmp.replace(out)
    return n
