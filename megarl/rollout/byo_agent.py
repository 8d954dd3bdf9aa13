"""Bring your own agent: megarl trains agent code written against the ``openai`` package, unchanged.

``agent.entrypoint: package.module:function`` (or ``path/to/file.py:function``) is called once
per trajectory as ``function(base_url=..., api_key=..., record=...)``: ``base_url`` is the gateway
(``megarl/rollout/gateway.py``), ``api_key`` this trajectory's own key, ``record`` the data record
as a dict (``prompt``, ``answer``, ``metadata``, ``index``). A plain function runs in a thread
pool (``agent.concurrency`` threads); an ``async def`` runs on its own event loop in such a thread
(an agent that blocks cannot stall the gateway). It returns the reward (a float), or None: then
megarl's reward function (``reward.*``) scores the text of the trajectory's last call.

Every call the agent makes is recorded token for token (``call_trajectory.py``); each trained
segment becomes a :class:`Sample` of the trajectory's group with the trajectory's reward. As in the
built-in loop a reward that cannot be had is a failure, never 0 (``Sample.fail``): the agent
raised (``agent_error``), ran past ``agent.trajectory_timeout_s`` (``agent_timeout``), made no
call (``no_calls``), or returned a non-finite reward. An agent that raised after a limit of the
model's own cut its call (turns, tokens: ``CallSession.truncated``) is not failed: what it recorded
is scored by the reward function, like a truncated built-in trajectory.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megarl.envs.entrypoint import load_entrypoint
from megarl.envs.parsers import get_parser
from megarl.rewards.failures import Failure, checked_score, failure_of
from megarl.rollout.call_session import CallLimits, CallSession
from megarl.rollout.call_trajectory import ChatRender
from megarl.rollout.gateway import Gateway
from megarl.rollout.manager import sample_seed
from megarl.rollout.sample import Sample

Score = Callable[[list[str], list[Any]], list[Any]]    # a reward pool's score(texts, records)


@dataclass
class ByoSettings:
    entrypoint: str
    tool_parser: str = "hermes"
    limits: CallLimits = dataclasses.field(default_factory=CallLimits)
    trajectory_timeout_s: float = 600.0
    concurrency: int = 64
    segments: str = "all"                 # all | last
    keep_versions: bool = False           # off-policy sources: resumable calls, per-token versions
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "megarl-policy"
    entrypoint_args: dict[str, Any] = dataclasses.field(default_factory=dict)   # passed on every call


def record_dict(record: Any) -> dict[str, Any]:
    """The record as the agent gets it: a plain dict (the agent need not import megarl)."""
    if dataclasses.is_dataclass(record):
        return {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return dict(record) if isinstance(record, dict) else {"prompt": record}


def _run_agent(fn: Callable[..., Any], base_url: str, api_key: str, record: dict[str, Any],
               started: Callable[[], None], extra: dict[str, Any]) -> Any:
    """In a pool thread: a plain function is called, a coroutine function runs on a loop of its own.
    ``started`` first: the trajectory's deadline counts from here, not from its wait for a thread.
    ``extra`` is ``agent.entrypoint_args``."""
    started()
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(base_url=base_url, api_key=api_key, record=record, **extra))
    out = fn(base_url=base_url, api_key=api_key, record=record, **extra)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out
        return asyncio.run(wait())
    return out


class ByoAgentRollout:
    """A ``GroupRollout`` (off-policy sources) and ``generate`` (sync), like ``AgentRollout``."""

    def __init__(self, manager: Any, sampling: dict[str, Any], tokenizer: Any, settings: ByoSettings,
                 score: Optional[Score] = None, template_kwargs: Optional[dict[str, Any]] = None):
        self.manager, self.sampling, self.s, self.score = manager, dict(sampling), settings, score
        self.fn = load_entrypoint(settings.entrypoint)
        self.render = ChatRender(tokenizer, template_kwargs)
        self.tok = tokenizer
        self.parse = get_parser(settings.tool_parser)
        self.gateway = Gateway(settings.model, settings.host, settings.port)
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.concurrency, thread_name_prefix="megarl-agent")
        self._scorer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-agent-score")
        self.resumed = 0
        self.sessions: collections.deque[CallSession] = collections.deque(maxlen=1024)   # recent (tests read them)

    # ------------------------------------------------------------------ one trajectory
    async def trajectory(self, record: Any, seed: Optional[int], job_index: int,
                         sampling: Optional[dict[str, Any]] = None, segments: Optional[str] = None) -> list[Sample]:
        """The trajectory's samples (one per trained segment), unscored when the agent gave no reward
        (``info["byo_reward"]`` is None then; :meth:`_score_missing` fills it in)."""
        s = self.s
        base_url = await self.gateway.start()
        loop = asyncio.get_running_loop()
        session = CallSession(self.manager, self.render, self.parse, sampling or self.sampling, s.limits, seed,
                              job_index, s.keep_versions, s.model, deadline=float("inf"))
        self.sessions.append(session)
        key = session.key = self.gateway.open(session)

        def started() -> None:
            loop.call_soon_threadsafe(setattr, session, "deadline", loop.time() + s.trajectory_timeout_s)
        fut = loop.run_in_executor(self.pool, _run_agent, self.fn, base_url, key, record_dict(record), started,
                                   s.entrypoint_args)
        reward: Any = None
        failure: Optional[Failure] = None
        try:
            while not fut.done() and loop.time() < session.deadline:
                wait = session.deadline - loop.time()
                await asyncio.wait({fut}, timeout=min(wait, 1.0) if wait != float("inf") else 1.0)
            if not fut.done():
                failure = Failure("agent_timeout", f"the agent ran past agent.trajectory_timeout_s "
                                                   f"({s.trajectory_timeout_s:g} s)")
            else:
                reward = fut.result()
        except Exception as err:  # noqa: BLE001 - the agent's exception: a failed sample, never a 0
            if not session.truncated or session.cut:
                failure = failure_of(err, "agent_error")
        finally:
            if not fut.done():    # deadline, or the rollout stopped (source closed): the thread is abandoned;
                # its later calls are refused and whatever it raises then is nobody's to report
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            why = ("the agent returned" if fut.done() else "the deadline passed"
                   if loop.time() >= session.deadline else "the rollout stopped")
            self.gateway.close(key, why)
            self.resumed += session.resumed      # the off-policy source's rollout/resumed_requests
        if reward is not None and failure is None:
            reward = checked_score(reward)
            if isinstance(reward, Failure):
                failure, reward = reward, None
        trained = session.trajectory.trained(segments or s.segments)
        if not trained and failure is None:
            failure = Failure("no_calls", "the agent made no completion call")
        last = max(trained, key=lambda seg: seg.serial) if trained else None   # the segment of the last call
        samples = [self._sample(record, seg, session, i, len(trained), seg is last) for i, seg in enumerate(trained)]
        if not samples:
            samples = [self._empty_sample(record, session)]
        for smp in samples:
            if failure is not None:
                smp.fail(failure)
            else:
                smp.info["byo_reward"] = reward
                smp.reward = float(reward) if reward is not None else 0.0
        return samples

    def _sample(self, record: Any, seg: Any, session: CallSession, i: int, n: int, last: bool) -> Sample:
        """One trained segment; ``last``: it holds the trajectory's last call (its text is what a
        reward function scores, a truncation is its)."""
        info = {"turns": seg.calls, "tool_calls": seg.tool_calls, "tool_errors": seg.tool_errors, "call_errors": 0,
                "tool_timeouts": 0, "truncated": session.truncated if last else "",
                "env_tokens": seg.template_tokens, "segment": i, "segments": n, "last_call": last}
        finish = "length" if session.truncated and last else seg.finish_reason
        return Sample(record, 0, list(seg.prompt_ids), list(seg.ids), list(seg.logprobs), finish, text=seg.text,
                      versions=list(seg.versions) if self.s.keep_versions else [], loss_mask=list(seg.mask), info=info)

    def _empty_sample(self, record: Any, session: CallSession) -> Sample:
        """A failed trajectory without any call still takes its place in the group (nothing trains on it)."""
        from megarl.envs.calculator import question_messages

        try:
            prompt = self.render.turns.prompt_ids(question_messages(record))
        except Exception:  # noqa: BLE001 - a record the template cannot render: any one token will do
            prompt = [int(self.tok.eos_token_id or 0)]
        eos = int(self.tok.eos_token_id or 0)
        info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "call_errors": 0, "tool_timeouts": 0,
                "truncated": session.truncated, "env_tokens": 1, "segment": 0, "segments": 0}
        return Sample(record, 0, prompt, [eos], [0.0], "stop", loss_mask=[0], info=info)

    async def _score_missing(self, trajectories: list[list[Sample]]) -> None:
        """Trajectories whose agent returned None: the reward function scores the last call's text."""
        todo = [t for t in trajectories if not t[-1].failed and t[-1].info.get("byo_reward", 0) is None]
        if not todo:
            return
        if self.score is None:
            for t in todo:
                for smp in t:
                    smp.fail(Failure("no_reward", "the agent returned None and the run has no reward function"))
            return
        loop = asyncio.get_running_loop()
        finals = [next((smp for smp in t if smp.info.get("last_call")), t[-1]) for t in todo]
        scores = await loop.run_in_executor(self._scorer, self.score, [smp.text for smp in finals],
                                            [smp.record for smp in finals])
        for t, score in zip(todo, scores):
            score = checked_score(score)
            for smp in t:
                if isinstance(score, Failure):
                    smp.fail(score)
                else:
                    smp.reward = float(score)

    # ------------------------------------------------------------------ groups
    async def _group(self, record: Any, seeds: list[Optional[int]], first_job: int,
                     sampling: Optional[dict[str, Any]] = None, segments: Optional[str] = None) -> list[Sample]:
        trajectories = list(await asyncio.gather(*(self.trajectory(record, seed, first_job + k, sampling, segments)
                                                   for k, seed in enumerate(seeds))))
        await self._score_missing(trajectories)
        return [smp for t in trajectories for smp in t]

    async def __call__(self, job: Any) -> list[Sample]:
        """``GroupRollout`` (off-policy sources): the n trajectories of one prompt."""
        return await self._group(job.record, list(job.seeds), job.job_index)

    def generate(self, records: list[Any], n: int, seed_base: Optional[int] = None, greedy: bool = False,
                 on_group: Optional[Callable[[list[Sample]], None]] = None) -> list[Sample]:
        """``n`` trajectories per record, all concurrently; group ``g`` = record ``g``. Greedy jobs
        (eval, ReMax) keep each trajectory's last segment only."""
        sampling = dict(self.sampling)
        if greedy:
            sampling.update(temperature=0.0, top_p=1.0, top_k=-1)
        self.sessions.clear()

        async def batch() -> list[list[Sample]]:
            return list(await asyncio.gather(*(
                self._group(rec, [None if seed_base is None else sample_seed(seed_base, p * n + k) for k in range(n)],
                            p * n, sampling, "last" if greedy else None)
                for p, rec in enumerate(records))))
        groups = self.manager.io.run(batch())
        out = []
        for g, group in enumerate(groups):
            for smp in group:
                smp.group = g
            if on_group is not None:
                on_group(group)
            out += group
        return out

    def close(self) -> None:
        try:
            self.manager.io.run(self.gateway.stop(), timeout=10)
        except Exception:  # noqa: BLE001 - teardown: a loop already closed has nothing to stop
            pass
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._scorer.shutdown(wait=False, cancel_futures=True)
