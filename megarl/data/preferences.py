"""Preference pairs (``prompt / chosen / rejected``) for reward-model training."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megarl.data.records import PromptRecord
from megarl.data.sources import DataError


@dataclass
class PreferencePair:
    prompt: PromptRecord
    chosen: str
    rejected: str


def load_preferences(path: str | Path, prompt_key: str = "prompt", chosen_key: str = "chosen",
                     rejected_key: str = "rejected") -> list[PreferencePair]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    else:
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append((f"{path}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
    pairs = []
    for where, row in rows:
        missing = [k for k in (prompt_key, chosen_key, rejected_key) if not isinstance(row.get(k), (str, list))]
        if missing:
            raise DataError(f"{where}: missing or non-text field(s) {missing} (data.prompt_key/chosen_key/rejected_key)")
        meta: dict[str, Any] = {k: v for k, v in row.items() if k not in (prompt_key, chosen_key, rejected_key)}
        pairs.append(PreferencePair(PromptRecord(row[prompt_key], metadata=meta, index=len(pairs)),
                                    _text(row[chosen_key]), _text(row[rejected_key])))
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


def _text(value: str | list) -> str:
    """A response given as chat messages keeps the assistant turns' text."""
    if isinstance(value, str):
        return value
    return "".join(m["content"] for m in value if m.get("role") == "assistant")
