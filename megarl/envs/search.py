"""``search``: Search-R1-style retrieval -- the model queries a local corpus (BM25, ``bm25s``)
over several turns, then answers; reward = exact match of the normalised answer.

``agent.env_args``: ``corpus`` (a JSONL file, one ``{"text": ...}`` (or ``"contents"``) per line,
or a list of strings), ``top_k`` (passages per query, default 3), ``system_prompt``. The index is
built once per corpus and process and shared by every trajectory (environments are per
trajectory, indexes are not).
"""
from __future__ import annotations

import json
import re
import string
import threading
from pathlib import Path
from typing import Any

from megarl.envs.base import EnvContext, Message
from megarl.envs.calculator import question_messages, record_answer
from megarl.envs.tool_env import ToolEnv, tool_prompt
from megarl.envs.tools import Tool

_INDEXES: dict[str, "BM25Index"] = {}
_LOCK = threading.Lock()
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class BM25Index:
    """A bm25s index over passages (English stopwords removed, lower-cased)."""

    def __init__(self, passages: list[str]):
        import bm25s

        if not passages:
            raise ValueError("agent.env_args.corpus: the search corpus is empty")
        self.passages = passages
        self.bm25 = bm25s.BM25()
        self.bm25.index(bm25s.tokenize(passages, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        import bm25s

        k = max(1, min(int(k), len(self.passages)))
        tokens = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            return []
        docs, scores = self.bm25.retrieve(tokens, k=k, show_progress=False)
        return [(self.passages[int(d)], float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]


def load_corpus(corpus: Any) -> list[str]:
    if isinstance(corpus, list):
        return [str(p) for p in corpus]
    path = Path(str(corpus)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"agent.env_args.corpus: {path} does not exist")
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(str(row.get("text", row.get("contents", ""))) if isinstance(row, dict) else str(row))
    return out


def shared_index(corpus: Any) -> BM25Index:
    key = json.dumps(corpus) if isinstance(corpus, list) else str(corpus)
    with _LOCK:
        if key not in _INDEXES:
            _INDEXES[key] = BM25Index(load_corpus(corpus))
        return _INDEXES[key]


def normalise(text: str) -> str:
    """SQuAD/Search-R1 answer normalisation: lower case, no punctuation, articles or extra spaces."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def exact_match(text: str, reference: Any) -> float:
    found = _ANSWER.findall(text)
    answer = found[-1] if found else text
    refs = reference if isinstance(reference, list) else [reference]
    return float(any(normalise(answer) == normalise(str(r)) for r in refs))


class SearchEnv(ToolEnv):
    INTRO = ("Answer the question. Search the knowledge base as often as you need, then give the final answer "
             "as <answer>...</answer>.")

    def __init__(self, ctx: EnvContext):
        if "corpus" not in ctx.args:
            raise ValueError("agent.env_args.corpus is required for the search environment (JSONL file or list)")
        self.index = shared_index(ctx.args["corpus"])
        self.top_k = int(ctx.args.get("top_k", 3))
        super().__init__(ctx)
        self.system = ctx.args.get("system_prompt") or tool_prompt(self.make_tools(), self.INTRO)

    def make_tools(self) -> list[Tool]:
        def search(query: str, k: int = self.top_k) -> str:
            hits = self.index.search(str(query), k)
            if not hits:
                return "No results."
            return "\n".join(f"[{i + 1}] {text}" for i, (text, _) in enumerate(hits))
        return [Tool("search", "Search the knowledge base; returns the best matching passages.",
                     {"type": "object", "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
                      "required": ["query"]}, search)]

    def opening(self, record: Any) -> list[Message]:
        return [{"role": "system", "content": self.system}] + question_messages(record)

    def score(self, text: str, record: Any) -> float:
        return exact_match(text, record_answer(record))
