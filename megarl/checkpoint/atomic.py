"""Publishing a folder written elsewhere, so readers see the old one or the new one, never half."""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished ``tmp`` folder to ``final``. An existing ``final`` is first renamed aside
    and only deleted once the new folder is in place, so a crash at any point leaves a whole
    folder at ``final`` (old or new), never a mixture."""
    tmp, final = Path(tmp), Path(final)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final
