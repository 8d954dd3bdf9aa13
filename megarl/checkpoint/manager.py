"""A run's checkpoints: one manager of stateful parts, written whole or not at all.

A checkpoint is a folder ``step_NNNNNN`` under the run's checkpoint directory holding

* one folder per trainable role (``actor/``, ``critic/``), written by that role's ranks
  (megatron torch_dist: model, optimizer, LR schedule, RNG) through ``save_checkpoint(dir)``;
* ``trainer_state.json``: the union of the driver-side parts' ``state_dict()`` (the trainer's
  step, KL coefficient and RNG; the rollout source's loader position and buffer), one flat JSON
  object, so every part reads back the keys it wrote.

Why one manager: the loop, the time-limit signal and a lost server all write the same checkpoint,
and a resume must restore exactly the parts that were saved; the parts are declared once, when
the trainer is built, instead of being listed again at every save and load.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional, Protocol

from megarl.checkpoint.atomic import replace_dir

STATE_FILE = "trainer_state.json"


class Stateful(Protocol):
    """A driver-side part whose state is a JSON object (keys disjoint from the other parts')."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RoleState(Protocol):
    """A role whose ranks write and read their own state under a folder."""

    def call(self, method: str, *args: Any) -> list[Any]: ...


class NotACheckpoint(FileNotFoundError):
    """``checkpoint.resume`` names a folder that is not a megarl checkpoint."""


class CheckpointManager:
    def __init__(self, root: Path, keep_last: int = 0):
        self.root = Path(root)
        self.keep_last = keep_last
        self.parts: dict[str, Stateful] = {}
        self.roles: dict[str, RoleState] = {}

    def register(self, name: str, part: Stateful) -> None:
        self.parts[name] = part

    def register_role(self, name: str, group: RoleState) -> None:
        self.roles[name] = group

    def save(self, step: int) -> Path:
        """Write step ``step``'s checkpoint to a temporary folder and rename it into place (a
        checkpoint is whole or absent), then prune old ones. Returns its folder."""
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp_step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, group in self.roles.items():
            group.call("save_checkpoint", str(tmp / name))
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            piece = part.state_dict()
            clash = set(piece) & set(state)
            if clash:
                raise ValueError(f"checkpoint part {name!r} writes keys another part wrote: {sorted(clash)}")
            state.update(piece)
        (tmp / STATE_FILE).write_text(json.dumps(state))
        replace_dir(tmp, final)
        prune_checkpoints(self.root, self.keep_last)
        return final

    def find(self, resume: str) -> Optional[Path]:
        """``checkpoint.resume``: ``none`` -> None, ``auto`` -> the newest checkpoint (None when
        there is none yet), else that folder, which must be a megarl checkpoint."""
        if resume == "none":
            return None
        path = latest_checkpoint(self.root) if resume == "auto" else Path(resume)
        if path is not None and not (path / STATE_FILE).is_file():
            raise NotACheckpoint(f"checkpoint.resume: {path} is not a megarl checkpoint (no {STATE_FILE})")
        return path

    def load(self, path: Path) -> dict[str, Any]:
        """Every role and part back to the state saved in ``path``; returns the saved JSON."""
        state = json.loads((path / STATE_FILE).read_text())
        for name, group in self.roles.items():
            group.call("load_checkpoint", str(path / name))
        for part in self.parts.values():
            part.load_state_dict(state)
        return state


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (``keep_last`` 0: keep every one);
    returns what was deleted. The newest is never deleted: it was just written."""
    if keep_last <= 0:
        return []
    old = sorted(Path(ckpt_dir).glob("step_*"))[:-keep_last]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    ckpt_dir = Path(ckpt_dir)
    found = sorted(ckpt_dir.glob("step_*")) if ckpt_dir.is_dir() else []
    return found[-1] if found else None
