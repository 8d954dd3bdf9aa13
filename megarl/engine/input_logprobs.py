"""Log-probabilities of the tokens a request *gives* (SGLang's input logprobs), not of those it samples.

Why: a distillation teacher scores the student's tokens -- prompt and response sent as
``input_ids`` with ``return_logprob``, ``logprob_start_len`` and ``max_new_tokens: 0`` -- and reads
``meta_info.input_token_logprobs``. The embedded engine answers as SGLang 0.5.23 does
(``scheduler.py`` sets the start, ``logprob_result_processor.py`` shapes the list):

* ``logprob_start_len`` -1 (the default) or ``return_logprob`` false: no input logprobs;
* a start past the input's length is refused (SGLang aborts the request with this message);
* otherwise one entry ``[logprob, token_id, None]`` per input position ``start .. len - 1``, the first
  one's logprob ``None`` (SGLang computes position ``i``'s logprob from hidden state ``i - 1`` for
  ``i > start`` only), each ``log_softmax(raw logits)`` of the next token -- no temperature, as
  SGLang's input logprobs.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


def logprob_start(value: Any, return_logprob: bool, input_len: int) -> int:
    """A request's ``logprob_start_len`` as the engine keeps it: -1 for none, else a position in
    ``[0, input_len]``; ``ValueError`` with SGLang's words for one past the input."""
    if not return_logprob or value is None:
        return -1
    start = int(value)
    if start < 0:
        return -1
    if start > input_len:
        raise ValueError(f"logprob_start_len={start} is higher than the number of input tokens {input_len}. "
                         f"Please use a smaller logprob_start_len.")
    return start


def input_token_logprobs(ids: Sequence[int], start: int, logprobs: Sequence[float]) -> List[list]:
    """``meta_info.input_token_logprobs``: ``logprobs`` are ``log p(ids[i])`` for ``i`` in
    ``start + 1 .. len(ids) - 1``, in order."""
    if start >= len(ids):
        return []
    if len(logprobs) != len(ids) - 1 - start:
        raise ValueError(f"{len(logprobs)} logprobs for input positions {start + 1}..{len(ids) - 1}")
    return [[None, int(ids[start]), None]] + [[float(lp), int(t), None] for lp, t in zip(logprobs, ids[start + 1:])]


def score_inputs(handle: Any, requests: Sequence[Any]) -> None:
    """Fill ``input_logprobs`` of every request with a start (on the engine thread: one forward per
    distinct prompt, adapter and start; the ``n`` samples of a prompt share it)."""
    done: dict[tuple, Optional[list]] = {}
    for r in requests:
        if r.logprob_start_len < 0:
            continue
        key = (r.key, r.logprob_start_len)
        if key not in done:
            lps = (handle.prompt_logprobs(list(r.input_ids), r.logprob_start_len, r.lora)
                   if r.logprob_start_len < len(r.input_ids) else None)
            done[key] = input_token_logprobs(r.input_ids, r.logprob_start_len,
                                             [] if lps is None else lps.cpu().tolist())
        r.input_logprobs = done[key]
