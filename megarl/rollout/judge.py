"""``reward.kind: judge``: a served model grades each response (LLM-as-judge).

The judge is an inference server speaking SGLang's ``/generate`` (SGLang itself or ``megarl
serve``), given by ``reward.judge.server_url`` or started by megarl from ``reward.judge.model_path``
(``rollout/judge_server.py``). For a batch of samples the scorer

1. renders each sample's judge prompt (``rewards/judge.py``: template, chat template of the judge's
   tokenizer) and tokenizes it -- token ids travel, so the same request works whether or not the
   server loaded a tokenizer;
2. sends ``reward.judge.batch_size`` prompts per ``/generate`` request, ``max_concurrency`` requests
   at once, greedy (temperature 0: the same answer graded twice gets the same grade), each under
   its own deadline (``timeout_s``), tried again ``reward.retries`` times when it times out or fails;
3. parses each answer into a score in [0, 1].

What cannot be graded fails that sample, never scores it 0 (``rewards/failures.py``): a request
past its deadline (``judge_timeout``), an HTTP error (``judge_http_error``), a server that cannot be
reached (``judge_unreachable``), an answer without a grade (``judge_unparsable``), a judge prompt
longer than the judge's context (``judge_prompt_too_long``). The scorer has ``RewardPool``'s
interface (``score(texts, records)``, ``close()``), so ``SampleScorer`` uses it as it uses a pool.
"""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from megarl.rewards.failures import Failure, RewardFailed, Score, checked_score
from megarl.rewards.judge import GradeParser, make_parser, prompt_text, render
from megarl.rollout.client import LoopThread, RequestFailed, ServerError, SGLangClient, sampling_params

# the client's own timeout backs up the per-request deadline (which cancels the request first)
_CLIENT_GRACE_S = 30.0


class JudgeScorer:
    """Scores batches with a judge server. ``server``: a ``JudgeServer`` megarl started (waited for at
    the first batch, so its start-up overlaps the first rollout; stopped by ``close``), or None for
    a server given by URL."""

    def __init__(self, judge_cfg: Any, url: str, api_key: Optional[str], tokenizer: Any, retries: int = 0,
                 server: Any = None):
        self.cfg, self.tokenizer, self.retries, self.server = judge_cfg, tokenizer, retries, server
        self.parse: GradeParser = make_parser(judge_cfg)
        self.client = SGLangClient(url, max_concurrency=judge_cfg.max_concurrency,
                                   timeout_s=judge_cfg.timeout_s + _CLIENT_GRACE_S, retries=0, api_key=api_key)
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.sampling = sampling_params(max_new_tokens=judge_cfg.max_new_tokens, temperature=0.0, top_p=1.0,
                                        top_k=-1, stop_token_ids=stop)
        self.io = LoopThread()
        self._ready = server is None
        self._ready_lock = threading.Lock()
        self.requests = 0   # /generate requests sent (retries included), for tests and benchmarks

    # ------------------------------------------------------------------ prompts
    def prompt_ids(self, text: str, record: Any) -> list[int]:
        """The judge's prompt for one sample, as the judge tokenizer's ids."""
        body = render(self.cfg.template, prompt_text(record.prompt), text, getattr(record, "answer", None))
        if not self.cfg.chat:
            return [int(t) for t in self.tokenizer(body, add_special_tokens=True)["input_ids"]]
        messages = ([{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []) + [
            {"role": "user", "content": body}]
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # ------------------------------------------------------------------ scoring
    def score(self, texts: Sequence[str], records: Sequence[Any]) -> list[Score]:
        """One score or failure per response, in order."""
        if len(texts) != len(records):
            raise ValueError(f"{len(texts)} responses but {len(records)} records")
        if not texts:
            return []
        self._wait_ready()
        room = self.cfg.context_length - self.cfg.max_new_tokens
        prompts = [self.prompt_ids(text, record) for text, record in zip(texts, records)]
        out: list[Score] = [Failure("judge_prompt_too_long", f"judge prompt of {len(ids)} tokens > "
                                    f"reward.judge.context_length - max_new_tokens = {room}") for ids in prompts]
        todo = [i for i, ids in enumerate(prompts) if len(ids) <= room]
        size = max(1, self.cfg.batch_size)
        chunks = [todo[k:k + size] for k in range(0, len(todo), size)]
        graded = self.io.run(self._grade_all([[prompts[i] for i in chunk] for chunk in chunks]))
        for chunk, scores in zip(chunks, graded):
            for i, s in zip(chunk, scores):
                out[i] = s
        return out

    async def _grade_all(self, chunks: list[list[list[int]]]) -> list[list[Score]]:
        # the deadline of a request starts when it is sent, not while it waits for a slot
        slots = asyncio.Semaphore(max(1, self.cfg.max_concurrency))
        return list(await asyncio.gather(*(self._grade(chunk, slots) for chunk in chunks)))

    async def _grade(self, prompts: list[list[int]], slots: asyncio.Semaphore) -> list[Score]:
        """One request's prompts: their scores, or the request's failure for each after the retries."""
        failure = Failure("judge_unreachable", "no request was sent")
        for _ in range(self.retries + 1):
            self.requests += 1
            try:
                async with slots:
                    outs = await asyncio.wait_for(self.client.generate(prompts, self.sampling, return_logprob=False),
                                                  self.cfg.timeout_s)
            except asyncio.TimeoutError:
                failure = Failure("judge_timeout", f"{self.client.url}: no answer within "
                                                   f"reward.judge.timeout_s = {self.cfg.timeout_s:g}s")
                continue
            except RequestFailed as err:
                failure = Failure("judge_http_error", str(err)[:300])
                continue
            except ServerError as err:
                failure = Failure("judge_unreachable", str(err)[:300])
                continue
            if len(outs) != len(prompts):
                failure = Failure("judge_http_error", f"{self.client.url}: {len(outs)} answers to {len(prompts)} prompts")
                continue
            return [self._grade_answer(o) for o in outs]
        return [failure] * len(prompts)

    def _grade_answer(self, out: Any) -> Score:
        text = (self.tokenizer.decode(out.output_ids, skip_special_tokens=True) if out.output_ids
                else out.text or "")
        try:
            return checked_score(self.parse(text))
        except RewardFailed as err:
            return Failure(err.reason, str(err)[:300])
        except Exception as err:  # noqa: BLE001 - a user parser's error is that sample's failure
            return Failure("judge_parser_error", f"{type(err).__name__}: {err}"[:300])

    def _wait_ready(self) -> None:
        with self._ready_lock:
            if not self._ready:
                self.server.wait_healthy()
                self._ready = True

    def close(self) -> None:
        try:
            self.io.run(self.client.close(), timeout=10)
        finally:
            self.io.close()
            if self.server is not None:
                self.server.stop()


def build_judge(cfg: Any, log_dir: Path) -> JudgeScorer:
    """The run's judge: the server at ``reward.judge.server_url`` (key from ``api_key_env``), or one
    megarl starts from ``reward.judge.model_path`` (an HF folder); the tokenizer is
    ``judge.tokenizer`` or the model's."""
    from transformers import AutoTokenizer

    from megarl.rollout.judge_server import JudgeServer

    j = cfg.reward.judge
    tokenizer = AutoTokenizer.from_pretrained(str(Path(j.tokenizer or j.model_path).expanduser()))
    if j.server_url:
        key = os.environ.get(j.api_key_env) if j.api_key_env else None
        return JudgeScorer(j, j.server_url, key, tokenizer, cfg.reward.retries)
    server = JudgeServer(cfg, str(Path(j.model_path).expanduser()), log_dir)
    try:
        return JudgeScorer(j, server.url, server.api_key, tokenizer, cfg.reward.retries, server)
    except BaseException:
        server.stop()
        raise
