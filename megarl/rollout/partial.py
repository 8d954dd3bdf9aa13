"""Partial rollouts: a generation interrupted by a weight update continues from its own tokens.

With ``/pause_generation`` mode ``abort`` (SGLang 0.5.23), every request in flight is answered at
once with ``finish_reason: {"type": "abort"}`` and the tokens (and logprobs) it has so far; new
requests wait at the server until ``/continue_generation``. ``generate_resumable`` sends such a
request again as prompt + the tokens already produced, with the remaining token budget, and
concatenates the answers: the token ids are exactly the server's, in order; each token keeps the
logprob and the weight version it was sampled under (``megarl.wire.versions``), so the trainer
knows which policy produced what. Modes ``retract`` / ``in_place`` keep the request on the server;
it comes back as one answer whose ``meta_info.weight_versions`` spans say the same.

MoE routing replay: with ``routes_from`` each answer also carries the routed experts of the
positions the earlier answers had not covered (``routed_experts_start_len``), so the pieces abut
(``megarl.rollout.routed_experts.joined_routes``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from megarl.rollout.client import GenerateOutput
from megarl.wire.versions import token_versions, version_number

Send = Callable[..., Awaitable[GenerateOutput]]   # (input ids, sampling params[, routes_start=...])

MAX_EMPTY_ABORTS = 100   # aborted this often in a row without one new token: the server is not pausing


@dataclass
class Trajectory:
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]            # weight version of each output token
    finish_reason: str             # of the last answer: stop | length (abort only if the budget ran out)
    resumed: int = 0               # answers that ended in abort and were continued
    routes: list[Optional[str]] = field(default_factory=list)   # per answer: routed experts (routes_from)


def continuation_seed(seed: int, produced: int) -> int:
    """``sampling_seed`` of a continuation after ``produced`` tokens: a fresh stream (a server
    starts a request's noise at step 0, so reusing the seed would repeat the first tokens' noise)."""
    x = (int(seed) * 0x9E3779B1 + produced * 0x85EBCA77 + 0x2545F491) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return (x ^ (x >> 12)) & 0x7FFFFFFF


async def generate_resumable(send: Send, prompt_ids: list[int], sampling: dict[str, Any],
                             seed: Optional[int] = None, routes_from: Optional[int] = None) -> Trajectory:
    """One sample of ``prompt_ids``; answers that end in ``abort`` are continued from their tokens.
    ``routes_from``: also collect routed experts of positions ``[routes_from, len(prompt) +
    len(output) - 1)`` (a continuation starts at the previous answer's last token, which never ran)."""
    budget = int(sampling["max_new_tokens"])
    stops = set(int(t) for t in sampling.get("stop_token_ids") or ())
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    resumed, empty = 0, 0
    routes: list[Optional[str]] = []
    while True:
        params = dict(sampling, max_new_tokens=budget - len(ids))
        if sampling.get("min_new_tokens"):
            params["min_new_tokens"] = max(int(sampling["min_new_tokens"]) - len(ids), 0)
        if seed is not None:
            params["sampling_seed"] = seed if not ids else continuation_seed(seed, len(ids))
        if routes_from is None:
            out = await send(prompt_ids + ids, params)
        else:
            out = await send(prompt_ids + ids, params, routes_start=len(prompt_ids) + len(ids) - 1 if ids else routes_from)
            if out.output_ids:   # an answer without tokens: the next request covers its positions again
                routes.append(out.routed_experts)
        n = len(out.output_ids)
        if out.logprobs is None or len(out.logprobs) != n:
            raise ValueError(f"a /generate answer has {n} tokens but "
                             f"{'no' if out.logprobs is None else len(out.logprobs)} logprobs")
        ids.extend(int(t) for t in out.output_ids)
        lps.extend(float(x) for x in out.logprobs)
        versions.extend(version_number(v) for v in token_versions(out.meta_info, n))
        if out.finish_reason != "abort":
            return Trajectory(ids, lps, versions, out.finish_reason, resumed, routes)
        # SGLang finishes an aborted request on its next step, which may have sampled a stop token
        if ids and ids[-1] in stops and len(ids) >= int(sampling.get("min_new_tokens") or 0):
            return Trajectory(ids, lps, versions, "stop", resumed, routes)
        if len(ids) >= budget:
            return Trajectory(ids, lps, versions, "length", resumed, routes)
        empty = empty + 1 if n == 0 else 0
        if empty >= MAX_EMPTY_ABORTS:
            raise RuntimeError(f"a request was aborted {empty} times in a row without a new token: "
                               f"{out.meta_info.get('finish_reason')}")
        resumed += 1
