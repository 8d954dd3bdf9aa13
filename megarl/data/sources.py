"""Prompt sources: JSONL, parquet and procedurally generated reasoning-gym tasks.

A bad file fails with its path and line number before any worker starts, so a typo in row 90 000
of a dataset is not discovered after an hour of rollouts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megarl.data.records import PromptRecord
from megarl.errors import UserError


class DataError(UserError, ValueError):
    """A data file or task cannot be read; the message names the file and line or field."""


def _record_from_row(row: dict[str, Any], prompt_key: str, answer_key: str, where: str, index: int,
                     image_key: str = "images", base_dir: Path = Path(".")) -> PromptRecord:
    if prompt_key not in row:
        raise DataError(f"{where}: no field {prompt_key!r} (data.prompt_key); fields are {sorted(row)}")
    prompt = row[prompt_key]
    if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt)):
        raise DataError(f"{where}: field {prompt_key!r} must be a string or a list of {{role, content}} messages")
    from megarl.data.images import row_images

    images = row_images(row, prompt, image_key, base_dir, where)
    meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, image_key)}
    return PromptRecord(prompt=prompt, answer=row.get(answer_key), metadata=meta, index=index, images=images)


def load_jsonl(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
               image_key: str = "images") -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open() as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            records.append(_record_from_row(row, prompt_key, answer_key, f"{path}:{lineno}", len(records),
                                            image_key, path.parent))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def load_parquet(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                 image_key: str = "images") -> list[PromptRecord]:
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    rows = pq.read_table(path).to_pylist()
    if not rows:
        raise DataError(f"{path}: no records")
    return [_record_from_row(row, prompt_key, answer_key, f"{path} row {i}", i, image_key, path.parent)
            for i, row in enumerate(rows)]


def load_reasoning_gym(task: str, size: int, seed: int, task_args: dict[str, Any] | None = None) -> list[PromptRecord]:
    """Generate ``size`` prompts of a reasoning-gym task; the whole entry goes to metadata for scoring."""
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_args or {}))
    except (KeyError, ValueError, TypeError) as err:
        raise DataError(f"data.task {task!r} with data.task_args {task_args}: {err}") from None
    return [PromptRecord(prompt=entry["question"], answer=entry["answer"],
                         metadata={"reasoning_gym": {"question": entry["question"], "answer": entry["answer"],
                                                     "metadata": entry["metadata"]}}, index=i)
            for i, entry in enumerate(dataset)]


def load_split(cfg_data: Any, seed: int, split: str) -> list[PromptRecord]:
    """Train or eval records for a ``DataConfig``. Reasoning-gym eval prompts come from a distinct
    seed so the held-out split never repeats a training prompt."""
    if split not in ("train", "eval"):
        raise ValueError(split)
    if cfg_data.source == "reasoning_gym":
        size = cfg_data.num_train if split == "train" else cfg_data.num_eval
        records = load_reasoning_gym(cfg_data.task, size, seed if split == "train" else seed + 1_000_003,
                                     cfg_data.task_args)
        if split == "eval":
            train_questions = {r.prompt for r in load_reasoning_gym(cfg_data.task, cfg_data.num_train, seed, cfg_data.task_args)}
            records = [r for r in records if r.prompt not in train_questions]
        return records
    path = cfg_data.path if split == "train" else cfg_data.eval_path
    if path is None:
        return []
    loader = load_jsonl if cfg_data.source == "jsonl" else load_parquet
    records = loader(path, cfg_data.prompt_key, cfg_data.answer_key, cfg_data.image_key)
    if split == "eval" and cfg_data.num_eval:
        records = records[: cfg_data.num_eval]
    return records
