"""Read back what each metric sink wrote, from its local files only (no sink library client)."""
from __future__ import annotations

import json
import struct
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _wandb_records(path: Path):
    """W&B's transaction log (``run-*.wandb``): a 7-byte header ``:W&B`` + magic 0xBEE1 + version,
    then LevelDB-log blocks of 32 KiB holding records ``crc32 (4) | length (2) | type (1) | data``
    (type 1 full, 2 first, 3 middle, 4 last); each assembled record is a ``wandb_internal_pb2.Record``."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:                                  # block trailer: zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            yield parts + chunk
            parts = b""


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` from the offline run's ``.wandb`` file."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {run_dir}"
    out: dict[str, dict[int, float]] = {}
    for raw in _wandb_records(files[-1]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        step = int(row.get("_step", rec.history.step.num))
        for k, v in row.items():
            if not k.startswith("_") and isinstance(v, (int, float)):
                out.setdefault(k, {})[step] = float(v)
    return out


def mlflow_metrics(store: Path) -> dict[str, dict[int, float]]:
    """``{metric: {step: value}}`` of the one run in an MLflow file store: every metric is a file
    ``<experiment>/<run>/metrics/<name>`` of lines ``timestamp value step`` (``/`` in names makes
    folders)."""
    runs = [p for p in store.glob("*/*/metrics") if p.is_dir()]
    assert len(runs) == 1, runs
    out: dict[str, dict[int, float]] = {}
    for f in runs[0].rglob("*"):
        if f.is_file():
            name = str(f.relative_to(runs[0]))
            for line in f.read_text().splitlines():
                _, value, step = line.split()
                out.setdefault(name, {})[int(step)] = float(value)
    return out
