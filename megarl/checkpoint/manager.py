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

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Protocol

from megarl.checkpoint.atomic import replace_dir
from megarl.errors import UserError

STATE_FILE = "trainer_state.json"
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
_FULL_BYTES = 16 << 20   # a file system with less free than this after a failed save is full


class Stateful(Protocol):
    """A driver-side part whose state is a JSON object (keys disjoint from the other parts')."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RoleState(Protocol):
    """A role whose ranks write and read their own state under a folder."""

    def call(self, method: str, *args: Any) -> list[Any]: ...


class NotACheckpoint(FileNotFoundError):
    """``checkpoint.resume`` names a folder that is not a megarl checkpoint."""


class CheckpointNotWritten(UserError, OSError):
    """A checkpoint could not be written (a full disk, a quota, a lost mount): the partial folder
    is removed and the previous checkpoint stays the newest; the message names both and the cause."""


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
        for stale in self.root.glob(".tmp_step_*"):   # left by a run killed while writing: never valid
            shutil.rmtree(stale, ignore_errors=True)
        state: dict[str, Any] = {}
        for name, part in self.parts.items():
            piece = part.state_dict()
            clash = set(piece) & set(state)
            if clash:
                raise ValueError(f"checkpoint part {name!r} writes keys another part wrote: {sorted(clash)}")
            state.update(piece)
        try:
            tmp.mkdir(parents=True)
            for name, group in self.roles.items():
                group.call("save_checkpoint", str(tmp / name))
            (tmp / STATE_FILE).write_text(json.dumps(state))   # last: a folder without it is no checkpoint
        except Exception as err:
            cause = _storage_cause(err, self.root)   # read before the partial folder gives its space back
            shutil.rmtree(tmp, ignore_errors=True)
            if cause is None:
                raise
            previous = latest_checkpoint(self.root)
            raise CheckpointNotWritten(
                f"checkpoint of step {step} not written to {final}: {cause}; "
                + (f"the newest checkpoint is still {previous}" if previous else "there is no earlier checkpoint")
            ) from err
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


def _storage_cause(err: BaseException, root: Path) -> Optional[str]:
    """What the storage did, in one line, if the failed save was the storage's fault (full disk,
    quota, read-only or lost file system), else None. A rank's error comes back wrapped (its text
    kept), and some writers lose the errno on the way (torch's C++ writer says only "iostream
    error"), so an almost full file system under ``root`` counts too."""
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _STORAGE_ERRNOS:
            return f"{current.strerror} ({current.filename or root})"
        current = getattr(current, "cause", None) or current.__cause__ or current.__context__
    lines = [x.strip() for x in str(err).splitlines() if x.strip()]
    for code in _STORAGE_ERRNOS:
        for line in reversed(lines):
            if os.strerror(code) in line:
                return line
    try:
        free = shutil.disk_usage(root).free
    except OSError as gone:   # the file system itself went away
        return f"{root}: {gone.strerror}"
    if free < _FULL_BYTES:
        said = lines[-1] if lines else type(err).__name__
        return f"{os.strerror(errno.ENOSPC)} ({free // 1024} KiB free under {root}; the writer said: {said})"
    return None


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
    """The newest whole checkpoint (a ``step_*`` folder with its state file; the rename that puts
    a folder there happens after the file is written, so an older layout without it is skipped)."""
    ckpt_dir = Path(ckpt_dir)
    found = sorted(p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()) if ckpt_dir.is_dir() else []
    return found[-1] if found else None
