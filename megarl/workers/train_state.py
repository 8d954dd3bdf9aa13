"""Save and restore a trained role exactly: model (megatron torch_dist, reshardable), optimizer
(distributed-optimizer shards in torch_dist, otherwise one file per rank), LR schedule, step
count and every rank's RNG state.

The caller (the trainer) writes into a temporary folder and renames it into place once every role
has finished, so a crash mid-save never leaves a half checkpoint that ``resume`` would pick up.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from megarl.models.builder import unwrap
from megarl.workers.offload import own_optimizer_state
from megarl.models.lora import checkpoint_sharded_state, load_checkpoint_state   # LoRA: adapters only


def _sharded_optimizer(worker: Any) -> bool:
    """Only the distributed optimizer needs megatron's sharded optimizer format (its states are
    split over data-parallel ranks). Other optimizers save their plain state dict per rank: the
    sharded mapping of the bf16 (Float16) optimizer failed on GPU ("Param id N does not match any
    model sharded param", the norm weights) and a per-rank file resumes the same layout exactly."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in optimizers)


def _sharded_state(worker: Any, is_loading: bool = False) -> dict[str, Any]:
    chunks = [unwrap(c) for c in worker.chunks]
    if len(chunks) == 1:
        state = {"model": checkpoint_sharded_state(chunks[0])}
    else:
        state = {f"model{i}": checkpoint_sharded_state(c) for i, c in enumerate(chunks)}
    if worker.optimizer is not None and _sharded_optimizer(worker):
        # is_loading creates the Adam moments of a fresh optimizer so there is something to load into
        # dp_reshardable: every rank writes its own buffers (no gather); megatron-core 0.16.1's default
        # (fully_sharded_model_space) builds flattened ranges its own validation refuses
        state["optimizer"] = worker.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return state


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_train_state(worker: Any, path: str | Path) -> None:
    from megatron.core import dist_checkpointing

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    from megarl.checkpoint.megatron_io import _InProcessWrites, _save_strategy

    # in-process writer (megatron's forked writer processes hung intermittently from forked ranks)
    with _InProcessWrites():
        dist_checkpointing.save(_sharded_state(worker), str(path), sharded_strategy=_save_strategy())
    if worker.optimizer is not None and not _sharded_optimizer(worker):
        torch.save(worker.optimizer.state_dict(), path / f"optimizer_rank{worker.spec.rank}.pt")
    extra = {"steps": worker.steps, "rng": _rng_state(),
             "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else None}
    torch.save(extra, path / f"extra_rank{worker.spec.rank}.pt")


def load_train_state(worker: Any, path: str | Path) -> None:
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    loaded = dist_checkpointing.load(_sharded_state(worker, is_loading=True), str(path))
    chunks = [unwrap(c) for c in worker.chunks]
    if len(chunks) == 1:
        load_checkpoint_state(chunks[0], loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            load_checkpoint_state(chunk, loaded[f"model{i}"])
    if worker.optimizer is not None and _sharded_optimizer(worker):
        worker.optimizer.load_state_dict(loaded["optimizer"])
    elif worker.optimizer is not None:
        optim_file = path / f"optimizer_rank{worker.spec.rank}.pt"
        if not optim_file.is_file():
            raise FileNotFoundError(f"{optim_file}: optimizer state of rank {worker.spec.rank} missing "
                                    f"(resume needs the same number of ranks and layout)")
        worker.optimizer.load_state_dict(torch.load(optim_file, weights_only=False))
        # the fp16/bf16 optimizer keeps fp32 master copies; loading them above restores the
        # model params too (copied back on the next step); the model tensors were loaded already
    if worker.optimizer is not None:
        own_optimizer_state(worker.optimizer)   # offload must be able to release what was loaded
    extra = torch.load(path / f"extra_rank{worker.spec.rank}.pt", weights_only=False)
    worker.steps = extra["steps"]
    if worker.scheduler is not None and extra["scheduler"] is not None:
        worker.scheduler.load_state_dict(extra["scheduler"])
        worker.scheduler.num_steps = extra["scheduler"]["num_steps"]  # load_state_dict steps again
    random.setstate(extra["rng"]["python"])
    torch.set_rng_state(extra["rng"]["torch"])
    if "cuda" in extra["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng"]["cuda"])
