"""``megarl hub export HUB OUT --arg k=v ...``: a hub environment's own tasks as a JSONL dataset.

A recipe that trains a hub environment (``agent.entrypoint: megarl.envs.hubs.<hub>_hub:run``)
reads its prompts from ``data.path`` like any other; this writes that file from the
environment itself, with the same keyword arguments the recipe gives ``agent.entrypoint_args``,
so every row names a task the adapter's ``run`` can rebuild exactly.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import yaml

from megarl.envs.hubs import HUBS
from megarl.errors import UserError


class HubError(UserError, ValueError):
    """A hub command's input is wrong (one line naming the argument)."""


def parse_args_list(pairs: list[str]) -> dict[str, Any]:
    """``k=v`` pairs; each value read as YAML (numbers, booleans, lists, ``{a: 1}`` mappings)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise HubError(f"--arg {pair!r}: expected NAME=VALUE")
        try:
            out[key] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as e:
            raise HubError(f"--arg {key}: not a YAML value: {' '.join(str(e).split())}") from None
    return out


def export(hub: str, out: Path, args: dict[str, Any]) -> int:
    """Rows written by ``HUB``'s ``export_records(out, **args)``; the hub's package must be installed."""
    if hub not in HUBS:
        raise HubError(f"hub {hub!r}: unknown (known: {', '.join(sorted(HUBS))})")
    try:
        module = importlib.import_module(HUBS[hub])
    except ModuleNotFoundError as e:
        raise HubError(f"hub {hub}: needs the package {e.name!r} (pip install 'megarl[hubs]')") from None
    fn = module.export_records
    try:
        inspect.signature(fn).bind(out, **args)
    except TypeError as e:
        raise HubError(f"--arg: {hub} export_records{inspect.signature(fn)} cannot take {sorted(args)} ({e})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    return int(fn(out, **args))


def hub_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl hub", description="environment hubs trained as published "
                                     "(agent.entrypoint: megarl.envs.hubs.<hub>_hub:run)")
    sub = parser.add_subparsers(dest="action", required=True)
    exp = sub.add_parser("export", help="write a hub environment's tasks as a JSONL dataset (data.path)")
    exp.add_argument("hub", help=f"one of: {', '.join(sorted(HUBS))}")
    exp.add_argument("out", type=Path, help="JSONL file to write")
    exp.add_argument("--arg", action="append", default=[], metavar="NAME=VALUE",
                     help="a keyword argument of the hub's export (as in agent.entrypoint_args), value as YAML")
    args = parser.parse_args(argv)
    n = export(args.hub, args.out, parse_args_list(args.arg))
    print(f"megarl hub export: {n} tasks -> {args.out}", file=sys.stderr)
    return 0
