"""Shell variables the sbatch scripts need from a recipe, computed by the same config loader the
trainer uses (so the script and the run agree on output_dir and pool sizes).

    python -m megarl.planning.launch_info RECIPE [overrides...]
prints ``KEY=VALUE`` lines (shell-quoted) for ``eval``:

    MEGARL_OUTPUT_DIR   the run's output_dir
    MEGARL_NODES        nodes the recipe asks for (cluster.nodes)
    MEGARL_GPUS_PER_NODE
    MEGARL_PLACEMENT    colocated | disaggregated
    MEGARL_TRAIN_NODES  nodes of the trainer pool (disaggregated: actor + critic GPUs, rounded up)
    MEGARL_ROLLOUT_NODES nodes of the rollout pool (disaggregated; 0 when colocated)
"""
from __future__ import annotations

import shlex
import sys

from megarl.config import load_config
from megarl.config.schema import RunConfig


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pool_nodes(cfg: RunConfig) -> tuple[int, int]:
    """(trainer nodes, rollout nodes). Colocated: every role shares the trainer pool."""
    g = cfg.cluster.gpus_per_node
    if not g:
        return cfg.cluster.nodes, 0
    train_gpus = max([cfg.actor.gpus] + [getattr(cfg, r).gpus for r in ("critic", "ref", "reward_model", "teacher")
                                         if r in cfg.megatron_roles and cfg.placement.mode == "colocated"])
    if cfg.placement.mode == "colocated":
        return ceil_div(max(train_gpus, cfg.rollout.gpus), g), 0
    train_gpus = cfg.actor.gpus + (cfg.critic.gpus if cfg.critic.enabled else 0)
    return ceil_div(train_gpus, g), ceil_div(cfg.rollout.gpus, g)


def launch_vars(cfg: RunConfig) -> dict[str, str]:
    train, rollout = pool_nodes(cfg)
    return {
        "MEGARL_OUTPUT_DIR": cfg.output_dir,
        "MEGARL_NODES": str(cfg.cluster.nodes),
        "MEGARL_GPUS_PER_NODE": str(cfg.cluster.gpus_per_node),
        "MEGARL_PLACEMENT": cfg.placement.mode,
        "MEGARL_TRAIN_NODES": str(train),
        "MEGARL_ROLLOUT_NODES": str(rollout),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m megarl.planning.launch_info RECIPE [overrides...]", file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:], validate=True)
    for key, value in launch_vars(cfg).items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as err:  # noqa: BLE001 - the sbatch script prints this and stops
        print(f"megarl launch_info: {err}", file=sys.stderr)
        sys.exit(2)
