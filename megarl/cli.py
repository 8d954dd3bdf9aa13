"""``megarl`` command line: train, config, convert, plan, serve, eval.

Subcommands import their heavy machinery (megatron, ray, torch.distributed) lazily so that
``megarl config`` and ``--help`` answer in a fraction of a second and config errors surface before
anything heavy starts.

Errors have one path, here: an error the user caused (``megarl.errors``: a config field, a data
row, a missing file, a refused API key, an unreachable server, a model that does not fit) is one
line on stderr and exit status 2 -- also when it happened on a worker process and reached the
driver wrapped (once, by the driver, never once per rank); anything else keeps its traceback.
``megarl --debug COMMAND ...`` shows the traceback of every error.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from typing import Callable, Sequence

from megarl.config import dump_config, field_help, load_config, validate_config
from megarl.errors import USER_EXIT, RunStopped, user_error_line

# Subcommands implemented in their own modules: name -> "module:function(argv) -> int".
DELEGATED = {
    "convert": ("megarl.checkpoint.cli:convert_main", "HF <-> Megatron checkpoint conversion"),
    "serve": ("megarl.engine.cli:serve_main", "run the embedded rollout server (SGLang HTTP API)"),
    "plan": ("megarl.planning.cli:plan_main", "memory plan per role and GPU; exits 1 if the recipe does not fit"),
    "eval": ("megarl.evaluation:eval_main", "held-out accuracy/reward of a model on a recipe's eval split"),
    "ledger": ("megarl.rollout.ledger:ledger_main", "which prompts a run trained on across resumes; "
                                                    "exits 1 if one was repeated or skipped"),
    "hub": ("megarl.envs.hubs.cli:hub_main", "export a published environment hub's tasks (verifiers, OpenEnv) "
                                             "as a JSONL dataset for agent.entrypoint's hub adapters"),
    "data": ("megarl.data.prepare:data_main", "prepare downloaded datasets (gsm8k, math, dapo-math-17k, any "
                                              "JSONL/parquet) as megarl's chat JSONL with a held-out split"),
}


def _resolve(target: str) -> Callable[[list[str]], int] | None:
    module_name, _, func_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            return None
        raise
    return getattr(module, func_name, None)


def _config_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl config", description="print the resolved, validated config of a recipe")
    parser.add_argument("recipe", nargs="?", help="YAML recipe (omit with --fields)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.optim.lr=1e-6")
    parser.add_argument("--fields", action="store_true", help="list every field with type, default and help")
    parser.add_argument("--no-validate", action="store_true", help="only parse and type-check")
    parser.add_argument("--markdown", action="store_true", help="with --fields: the reference page as Markdown "
                        "(docs/reference/config.md)")
    args = parser.parse_args(argv)
    if args.fields and args.markdown:
        from megarl.config.reference import fields_markdown

        sys.stdout.write(fields_markdown())
        return 0
    if args.fields:
        for name, tp, help_text, default in field_help():
            print(f"{name:48s} {tp:28s} default={default!r}\n{'':48s} {help_text}")
        return 0
    if not args.recipe:
        parser.error("a recipe is required (or --fields)")
    cfg = load_config(args.recipe, args.overrides, validate=not args.no_validate)
    sys.stdout.write(dump_config(cfg))
    return 0


def train_main(argv: list[str]) -> int:
    """``megarl train RECIPE [overrides]``: validate, run, print one JSON summary line."""
    parser = argparse.ArgumentParser(prog="megarl train", description="run RL training from a recipe")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=5")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    validate_config(cfg, check_paths=True)
    _offload_from_plan(cfg, args.recipe)
    if cfg.trainer.mode == "reward_model":
        from megarl.reward_model_trainer import RewardModelTrainer

        results = RewardModelTrainer(cfg).run()
    else:
        from megarl.trainer import Trainer

        results = Trainer(cfg).run()
    summary = {k: v for k, v in results.items() if k != "steps"}
    summary["final_step"] = results["steps"][-1] if results["steps"] else {}
    print(json.dumps(summary, default=float))
    return 0


def _offload_from_plan(cfg, recipe: str) -> None:
    """Offload switches left null: on where the colocated layout needs them (the memory plan),
    said in one line; off otherwise."""
    from megarl.metrics_log import note
    from megarl.planning.memory import make_plan
    from megarl.planning.offload import resolve_offload

    line = resolve_offload(cfg, lambda c: make_plan(c, recipe, suggest=False))
    if line:
        note(line)


# Subcommands implemented in this module
LOCAL = {"config": (_config_main, "print the resolved, validated config of a recipe"),
         "train": (train_main, "run RL training from a recipe")}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl",
        description="Megatron-native RL post-training (PPO, GRPO, DAPO) with SGLang-API rollout.",
        epilog="Run `megarl COMMAND --help` for a command's options.",
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of every error, also of "
                        "errors caused by the input (config, data, files, servers), which are otherwise one line")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in {**LOCAL, **DELEGATED}.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    debug = False
    while argv and argv[0] == "--debug":                    # global options come before the command
        debug, argv = True, argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if not debug:
        # Ray prints every failed rank's task error that nobody fetched ("Unhandled error ...") on
        # the driver's stderr, whenever its reference is freed (also after this function): the
        # first one, which the driver did fetch, is reported below. Set for the whole process.
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        if command in LOCAL:
            return int(LOCAL[command][0](rest) or 0)
        if command not in DELEGATED:
            parser.error(f"unknown command {command!r}")
        func = _resolve(DELEGATED[command][0])
        if func is None:
            print(f"megarl {command}: not available yet in this version", file=sys.stderr)
            return USER_EXIT
        return int(func(rest) or 0)
    except RunStopped as stop:   # SIGTERM: the run ended at a phase boundary, with the requeue code
        print(f"megarl {command}: {stop}", file=sys.stderr)
        return stop.exit_code
    except Exception as err:  # noqa: BLE001 - the one place errors reach the user
        line = user_error_line(err)
        if line is None:
            raise                                            # megarl's own fault: the traceback
        if debug:
            traceback.print_exc()
        print(f"megarl {command}: {line}", file=sys.stderr)
        return USER_EXIT


if __name__ == "__main__":
    sys.exit(main())
