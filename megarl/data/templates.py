"""Turning prompt records into token ids with the tokenizer's own chat template."""
from __future__ import annotations

from typing import Any

from megarl.data.records import PromptRecord


def prompt_messages(record: PromptRecord, system_prompt: str | None) -> list[dict[str, str]]:
    messages = list(record.prompt) if isinstance(record.prompt, list) else [{"role": "user", "content": record.prompt}]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(tokenizer: Any, record: PromptRecord, *, chat_template: bool, system_prompt: str | None) -> list[int]:
    """Prompt token ids ending where the assistant's answer starts (generation prompt included)."""
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("data.chat_template is true but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(prompt_messages(record, system_prompt), add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    text = record.prompt if isinstance(record.prompt, str) else "\n".join(m["content"] for m in record.prompt)
    if system_prompt:
        text = f"{system_prompt}\n{text}"
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]
