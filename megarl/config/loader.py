"""YAML recipes and ``a.b.c=value`` overrides -> a typed ``RunConfig``.

Type errors, unknown keys (with the closest valid name) and bad literals are collected for the
whole tree and raised together, one line per problem naming the dotted field, so a user fixes a
recipe in one pass instead of one error per launch.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megarl.config.schema import RunConfig
from megarl.errors import UserError


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(UserError, ValueError):
    """A recipe or override is wrong; ``problems`` holds one line per field."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str, problems: list[str]) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (ints to floats, dicts to dataclasses)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping (section), got {type(value).__name__} {value!r}")
            return tp()
        return _build(tp, value, path, problems)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{path}: {value!r} is not one of {', '.join(repr(c) for c in choices)}{hint}")
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            trial: list[str] = []
            converted = _convert(value, arg, path, trial)
            if not trial:
                return converted
        problems.append(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            problems.append(f"{path}: expected a list of {_type_name(item_tp)}, got {type(value).__name__} {value!r}")
            return []
        return [_convert(v, item_tp, f"{path}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
            return {}
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads "3e-5" (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {type(value).__name__} {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")


def _build(cls: type, data: dict[str, Any], prefix: str, problems: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)" if close else ""
            problems.append(f"{path}: unknown key{hint}")
            continue
        kwargs[key] = _convert(value, hints[key], path, problems)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """``a.b=1`` -> (``a.b``, 1); values are YAML scalars/lists so types follow the schema's check."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"override {item!r}: expected dotted.key=value"])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError([f"{key}: cannot parse value {raw!r}: {err}"]) from None
        parsed.append((key.strip(), value))
    return parsed


def load_config(recipe: str | Path | None = None, overrides: list[str] | None = None,
                validate: bool = True) -> RunConfig:
    """Read a recipe, apply overrides, type-check, and (by default) run every validation rule."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = Path(recipe)
        if not path.is_file():
            raise ConfigError([f"recipe {str(path)!r}: no such file"])
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError([f"recipe {path}: YAML error: {err}"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([f"recipe {path}: top level must be a mapping, got {type(loaded).__name__}"])
        tree = loaded
    for key, value in parse_overrides(overrides or []):
        _set_dotted(tree, key, value)
    problems: list[str] = []
    cfg = _build(RunConfig, tree, "", problems)
    if problems:
        raise ConfigError(problems)
    if validate:
        from megarl.config.validate import validate_config

        validate_config(cfg)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)


def field_help(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, Any]]:
    """(dotted name, type, help, default) for every leaf field — used by ``megarl config --help-fields``."""
    rows = []
    hints = typing.get_type_hints(cls)
    default_obj = cls()
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(field_help(tp, name + "."))
        else:
            rows.append((name, _type_name(tp), f.metadata.get("help", ""), getattr(default_obj, f.name)))
    return rows
