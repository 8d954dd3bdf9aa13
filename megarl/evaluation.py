"""``megarl eval RECIPE [overrides] [--model HF_DIR]``: held-out reward and accuracy of a model.

Uses the recipe's data, chat template, reward and rollout settings, serves the model (by default
the recipe's ``model.hf_path``; e.g. a run's ``OUTPUT_DIR/hf_export`` with ``--model``) on the
rollout engine, decodes greedily, and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megarl.config import load_config


def evaluate_model(cfg, model_dir: Path | None = None) -> dict[str, float]:
    """The run's data and rollout pipeline without any Megatron role: servers of ``model_dir``
    answer the held-out prompts greedily."""
    from megarl.rollout.launch import RolloutServers
    from megarl.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.setup_data()
        if model_dir is not None:
            trainer.model_dir = Path(model_dir)
        servers = RolloutServers(cfg, trainer.model_dir, trainer.out / "logs")
        trainer.servers = servers
        servers.wait_healthy()
        trainer.setup_rollout(servers)
        return trainer.evaluate()
    finally:
        trainer.close()


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl eval", description="held-out accuracy / reward of a model")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--model", type=Path, default=None, help="HF folder to evaluate (default: model.hf_path)")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json")
    print(json.dumps(evaluate_model(cfg, args.model)))
    return 0
