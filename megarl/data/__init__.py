"""Prompt data: sources (JSONL, parquet, reasoning-gym), chat templates, resumable batches."""
from megarl.data.loader import PromptLoader
from megarl.data.preferences import PreferencePair, load_preferences
from megarl.data.records import PromptRecord
from megarl.data.sources import DataError, load_jsonl, load_parquet, load_reasoning_gym, load_split
from megarl.data.templates import encode_prompt, prompt_messages

__all__ = ["DataError", "PreferencePair", "PromptLoader", "PromptRecord", "load_preferences", "encode_prompt", "load_jsonl", "load_parquet",
           "load_reasoning_gym", "load_split", "prompt_messages"]
