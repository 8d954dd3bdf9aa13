"""A served distillation teacher: servers that score the student's tokens over HTTP.

Why servers: a teacher larger than the trainer's GPUs can spare (or one already served for other
uses) need not be a Megatron role. SGLang's native ``/generate`` scores given tokens: the whole
sequence as ``input_ids``, ``return_logprob: true``, ``logprob_start_len`` and
``max_new_tokens: 0`` answer ``meta_info.input_token_logprobs`` -- ``[logprob, token_id, text]`` for
input positions ``logprob_start_len ..``, the first one's logprob ``None`` (SGLang 0.5.23,
``logprob_result_processor.py``; the embedded engine answers the same, ``engine/input_logprobs.py``).
With ``logprob_start_len = prompt_len - 1`` the entries after the first are exactly the response
tokens' log-probabilities under the teacher, from raw logits (no temperature), as the Megatron
teacher's ``compute_logprobs`` gives them.
"""
from __future__ import annotations

import asyncio
from typing import Any, List, Optional, Sequence

import torch

from megarl.data.batch import TokenBatch
from megarl.errors import UserError
from megarl.rollout.client import LoopThread, SGLangClient
from megarl.wire.protocol import INPUT_TOKEN_LOGPROBS


class ServedTeacherError(UserError, RuntimeError):
    """A teacher server answered without the scores asked for (a server that cannot return input
    logprobs, or one that scored other tokens); the message names the server."""


def scoring_request(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> dict[str, Any]:
    """The ``/generate`` body that scores ``sequences`` from each response's first token on."""
    return {"input_ids": [list(map(int, s)) for s in sequences],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": [int(p) - 1 for p in prompt_lens], "stream": False}


def response_logprobs(url: str, answer: Any, sequences: Sequence[Sequence[int]],
                      prompt_lens: Sequence[int]) -> List[List[float]]:
    """Each sequence's response-token logprobs from a scoring answer, checked: one item per sequence,
    one entry per token from ``prompt_len - 1`` on, echoing the tokens that were sent."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(sequences):
        raise ServedTeacherError(f"teacher server {url}: {len(items)} answers for {len(sequences)} sequences")
    out = []
    for item, seq, p in zip(items, sequences, prompt_lens):
        entries = ((item or {}).get("meta_info") or {}).get(INPUT_TOKEN_LOGPROBS)
        if entries is None:
            raise ServedTeacherError(f"teacher server {url}: no meta_info.input_token_logprobs in its answer (the "
                                     f"teacher needs a server that scores given tokens: SGLang, or megarl serve)")
        sent = [int(t) for t in seq[p - 1:]]
        got = [int(e[1]) for e in entries]
        if got != sent or any(e[0] is None for e in entries[1:]):
            raise ServedTeacherError(f"teacher server {url}: scored {len(got)} tokens {got[:8]}..., sent "
                                     f"{len(sent)} from position {p - 1} {sent[:8]}...")
        out.append([float(e[0]) for e in entries[1:]])
    return out


class ServedTeacher:
    """The teacher's log-probabilities of a batch's response tokens, from ``teacher.server_urls``:
    the batch is cut into requests of ``teacher.request_batch`` sequences, spread over the servers
    round-robin and sent concurrently."""

    def __init__(self, urls: Sequence[str], request_batch: int = 16, api_key: Optional[str] = None,
                 timeout_s: float = 600.0, retries: int = 2):
        self.urls = list(urls)
        self.request_batch = max(1, int(request_batch))
        self.clients = [SGLangClient(u, timeout_s=timeout_s, retries=retries, api_key=api_key) for u in self.urls]
        self.loop = LoopThread()

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Flat ``[sum of response lengths]`` fp32 log-probabilities in batch order (the layout of
        a Megatron role's ``compute_logprobs``)."""
        seqs = [batch.sequence(i).tolist() for i in range(len(batch))]
        plens = batch.prompt_lens.tolist()
        scored = self.loop.run(self._score(seqs, plens))
        flat = [lp for row in scored for lp in row]
        return torch.tensor(flat, dtype=torch.float32)

    async def _score(self, seqs: List[List[int]], plens: List[int]) -> List[List[float]]:
        n = self.request_batch
        parts = [(k, seqs[a:a + n], plens[a:a + n]) for k, a in enumerate(range(0, len(seqs), n))]

        async def one(k: int, s: List[List[int]], p: List[int]) -> List[List[float]]:
            client = self.clients[k % len(self.clients)]
            answer = await client.generate_raw(scoring_request(s, p))
            return response_logprobs(client.url, answer, s, p)

        done = await asyncio.gather(*(one(*part) for part in parts))
        return [row for rows in done for row in rows]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Every teacher server answers ``/health`` (``ServerDown`` naming the first that does not)."""
        for client in self.clients:
            self.loop.run(client.wait_healthy(timeout_s))

    def close(self) -> None:
        for client in self.clients:
            self.loop.run(client.close())
        self.loop.close()
