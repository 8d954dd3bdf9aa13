"""Fault injection shared by the fault tests and the soak benchmark: which processes a run has
below it, and a file system filled to the last byte."""
from __future__ import annotations

import os
from pathlib import Path


def process_tree(root: int) -> set[int]:
    """``root`` and every process descended from it (from /proc, by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, []))
    return seen


def fill_filesystem(folder: Path) -> Path:
    """Write ``folder/filler`` until the file system under ``folder`` is full; returns the file."""
    filler = folder / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler
