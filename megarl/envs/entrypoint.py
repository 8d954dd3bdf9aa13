"""``agent.entrypoint``: a user's agent function by ``package.module:function`` or ``path/to/file.py:function``.

Here, beside the environment registry, because validation (``config/``) checks the field before a
run starts and must not import ``rollout/`` (which imports ``config/``). A file path is read
relative to the working directory, so recipes can name an agent file next to them without making it
a package.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable


class EntrypointError(ValueError):
    """``agent.entrypoint`` does not name an importable callable (the message is one line naming the field)."""


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``file.py:function`` -> the function (EntrypointError naming the field)."""
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise EntrypointError(f"agent.entrypoint: {spec!r} must be package.module:function or path/to/file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            mod_name = "megarl_agent_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            module = sys.modules.get(mod_name)
            if module is None:
                loader = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(loader)
                loader.loader.exec_module(module)
                sys.modules[mod_name] = module
        else:
            module = importlib.import_module(where)
    except Exception as e:  # noqa: BLE001 - any import failure is the field's problem, said in one line
        words = " ".join(str(e).split())
        raise EntrypointError(f"agent.entrypoint: cannot import {where!r}: {type(e).__name__}: {words}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise EntrypointError(f"agent.entrypoint: {where!r} has no attribute {name!r}")
    if not callable(fn):
        raise EntrypointError(f"agent.entrypoint: {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


RESERVED = ("base_url", "api_key", "record")


def check_call(fn: Callable[..., Any], extra: dict[str, Any]) -> None:
    """The call megarl makes, ``fn(base_url=, api_key=, record=, **extra)``, binds to ``fn``'s signature
    (EntrypointError naming ``agent.entrypoint_args`` or ``agent.entrypoint``): a mismatch is found
    before any worker starts, not by the first trajectory."""
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise EntrypointError(f"agent.entrypoint_args must be a mapping of names to values, got {extra!r}")
    clash = sorted(set(extra) & set(RESERVED))
    if clash:
        raise EntrypointError(f"agent.entrypoint_args: {clash} are given by megarl on every call; remove them")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):     # a builtin or C callable without a signature: the call will tell
        return
    try:
        sig.bind(**{k: None for k in (*RESERVED, *extra)})
    except TypeError as e:
        field = "agent.entrypoint_args" if extra else "agent.entrypoint"
        raise EntrypointError(f"{field}: {getattr(fn, '__qualname__', fn)}{sig} cannot take "
                              f"{', '.join((*RESERVED, *extra))} ({e})") from None
