"""The unit of prompt data: one prompt with whatever its reward needs to score a response."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptRecord:
    """A prompt (plain text or chat messages), its reference answer, and scorer metadata.

    ``metadata`` travels untouched from the data source to the reward function; reasoning-gym
    keeps its whole task entry there because its scorers need the entry, not just the answer.
    """

    prompt: str | list[dict[str, Any]]
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = -1
    images: list[Any] = field(default_factory=list)    # data.images.ImageRef, in prompt order
