"""Judge helpers: parsers that read a random tiny judge's greedy answer deterministically, and
stub judge servers (one that never answers, one that answers garbage or a grade by the prompt)."""
from __future__ import annotations

import asyncio
import hashlib
import shutil
from pathlib import Path

from aiohttp import web

from megarl.rewards.judge import UnparsableGrade


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def digest_grade(text: str) -> float:
    """A grade in {0, 0.1, ..., 1} from the judge's answer (a random tiny model never writes
    'Score: N'; what matters is that the answer came back and is read the same way each time)."""
    if not text:
        raise UnparsableGrade("empty judge answer")
    return (_digest(text) % 11) / 10


def digest_grade_or_unparsable(text: str) -> float:
    """:func:`digest_grade`, but every answer whose digest is divisible by 3 has no grade."""
    if not text or _digest(text) % 3 == 0:
        raise UnparsableGrade(f"no grade in {text[:40]!r}")
    return digest_grade(text)


class StubJudge:
    """Answers ``/generate`` like SGLang (token ids in, ``output_ids`` out); ``answer(prompt_ids)``
    gives each prompt's answer text, or None for a request that never returns."""

    def __init__(self, tokenizer, answer):
        self.tokenizer, self.answer, self.requests = tokenizer, answer, 0
        self.closing = False   # set before the server's cleanup: a request that never returns returns then

    async def handle(self, request: web.Request) -> web.Response:
        if request.path == "/health":
            return web.Response(text="ok")
        body = await request.json()
        self.requests += 1
        prompts = body["input_ids"]
        texts = [self.answer(self.tokenizer.decode(p)) for p in prompts]
        if any(t is None for t in texts):   # never answers (the client's deadline ends the wait)
            while not self.closing:
                await asyncio.sleep(0.05)
            return web.json_response({"message": "closing"}, status=503)
        if any(t == "HTTP 500" for t in texts):
            return web.json_response({"message": "judge fell over"}, status=500)
        return web.json_response([{"output_ids": self.tokenizer.encode(t, add_special_tokens=False),
                                   "meta_info": {"finish_reason": {"type": "stop"}}} for t in texts])


def make_sharp_judge(path: Path, base: Path, std: float = 0.15) -> Path:
    """A judge model: ``base``'s architecture and tokenizer with random weights of std ``std``. A tiny
    model at its initial scale (0.02) answers every prompt with the same greedy tokens; at 0.15 the
    answer depends on the prompt, so the grades of different responses differ."""
    import torch
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return path
    model = AutoModelForCausalLM.from_pretrained(str(base))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    model.save_pretrained(path)
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation_config")):
            shutil.copy(f, path / f.name)
    return path
