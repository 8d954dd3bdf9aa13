"""Environments by name (built-ins, or ``register_env``) or by dotted path ``pkg.module:Class``.

Built-ins are named here as dotted paths, imported only when chosen, so a run that never uses
the search environment never imports its BM25 library.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

BUILTIN = {
    "calculator": "megarl.envs.calculator:CalculatorEnv",
    "python": "megarl.envs.python_env:PythonEnv",
    "search": "megarl.envs.search:SearchEnv",
}
_registered: dict[str, type] = {}


def register_env(name: str) -> Callable[[type], type]:
    """Class decorator: make an environment available as ``agent.env: NAME``."""
    def deco(cls: type) -> type:
        _registered[name] = cls
        return cls
    return deco


def env_class(name: str) -> type:
    """The environment class of ``name``: registered, built-in, or ``module:Class`` / ``module.Class``."""
    if name in _registered:
        return _registered[name]
    target = BUILTIN.get(name, name)
    if ":" in target:
        module, attr = target.split(":", 1)
    elif "." in target:
        module, attr = target.rsplit(".", 1)
    else:
        raise ValueError(f"agent.env: unknown environment {name!r} (built-ins: {sorted(BUILTIN)}, or module:Class)")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"agent.env: cannot load {target!r}: {e}") from e
    return cls


def make_env(name: str, ctx: Any) -> Any:
    """A fresh environment (one per trajectory)."""
    return env_class(name)(ctx)
