"""The agent loop: multi-turn rollouts against an environment, token in, token out.

For each trajectory: ``env.reset(record)`` gives the opening messages and tool schemas, rendered
once through the chat template into prompt tokens; then turns of

    generate (prompt + response so far, as token ids) -> decode the new tokens -> parse tool calls
    -> env.step -> tokenise ONLY the environment's text -> append -> generate ...

until the environment says done, ``agent.max_turns`` model turns, or the response token budget
(``agent.max_response_tokens``) is spent. The model's tokens enter the trajectory exactly as the
server returned them, with their rollout logprobs and loss mask 1; environment tokens get loss
mask 0 and logprob 0 (``megarl/rollout/trajectory.py``).

All trajectories of a batch run concurrently as coroutines on the rollout client's event loop, so
the servers see one request per live trajectory at a time and batch them; tools run in a thread
pool with per-call deadlines (``megarl/envs/tools.py``): a tool past its deadline ends only its
own trajectory, flagged ``truncated`` and counted. An environment step that raises (a sandbox that
crashed, a scorer that failed) ends its trajectory as a failed sample: no reward, never 0
(``megarl/rollout/failures.py``).
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megarl.envs.base import Action, EnvContext
from megarl.envs.parsers import get_parser
from megarl.envs.registry import make_env
from megarl.envs.tools import ToolPool
from megarl.rewards.failures import Failure, failure_of
from megarl.rollout.manager import sample_seed
from megarl.rollout.partial import Trajectory, generate_resumable
from megarl.rollout.routed_experts import joined_routes
from megarl.rollout.sample import Sample
from megarl.rollout.trajectory import ChatTurns, TrajectoryBuilder

TURN_SEED_STRIDE = 1_000_003


@dataclass
class AgentSettings:
    env: str
    env_args: dict[str, Any] = field(default_factory=dict)
    tool_parser: str = "hermes"
    max_turns: int = 4
    max_response_tokens: int = 512
    tool_timeout_s: float = 10.0
    tool_workers: int = 16
    keep_versions: bool = False        # off-policy sources: per-token weight versions
    routes: Optional[tuple[int, int]] = None   # MoE (layers, top_k): record routed experts (R3)
    routes_required: bool = False      # algorithm.routing_replay: rollout (a missing piece is an error)
    max_prompt_len: int = 0            # rollout.max_prompt_len: the opening must fit (0: unchecked)


@dataclass
class Clock:
    """Where a batch's rollout time went: generation requests vs. everything else (benchmark)."""

    generate_s: float = 0.0      # awaiting /generate answers (includes HTTP), summed over trajectories
    env_s: float = 0.0           # reset/step of environments (tools, sandbox), summed over trajectories
    tokenize_s: float = 0.0      # decode + parse + observation tokenisation, summed over trajectories
    trajectory_s: float = 0.0    # wall time of each trajectory, summed


class AgentRollout:
    """Runs trajectories; a ``GroupRollout`` for off-policy sources and ``generate`` for the sync loop."""

    def __init__(self, manager: Any, sampling: dict[str, Any], tokenizer: Any, settings: AgentSettings,
                 template_kwargs: Optional[dict[str, Any]] = None):
        self.manager, self.sampling, self.tok, self.s = manager, dict(sampling), tokenizer, settings
        self.turns = ChatTurns(tokenizer, template_kwargs)
        self.parse = get_parser(settings.tool_parser)
        self.pool = ToolPool(settings.tool_workers)
        self.clock = Clock()
        self.resumed = 0

    # ------------------------------------------------------------------ one trajectory
    async def trajectory(self, record: Any, seed: Optional[int], job_index: int,
                         sampling: Optional[dict[str, Any]] = None, routes: bool = True) -> Sample:
        """One trajectory. ``routes`` (MoE, ``settings.routes``): every turn asks for the routed
        experts of the positions the earlier turns did not cover -- the observation it prefills and
        the tokens it samples -- so the pieces join into the whole trajectory's routing."""
        s, clock = self.s, self.clock
        routed = routes and s.routes is not None
        pieces: list[Optional[str]] = []
        covered = 0                                   # positions [0, covered) have routes
        sampling = dict(sampling or self.sampling)
        per_turn = int(sampling["max_new_tokens"])
        env = make_env(s.env, EnvContext(self.pool, s.env_args, s.tool_timeout_s))
        info = {"turns": 0, "tool_calls": 0, "tool_errors": 0, "call_errors": 0, "tool_timeouts": 0, "truncated": "",
                "env_tokens": 0}
        traj = TrajectoryBuilder()
        reward, finish, texts = 0.0, "stop", []
        failure: Optional[Failure] = None
        started = time.perf_counter()
        try:
            t = time.perf_counter()
            messages, tools = await env.reset(record)
            prompt = self.turns.prompt_ids(messages, tools)
            clock.env_s += time.perf_counter() - t
            if s.max_prompt_len and len(prompt) > s.max_prompt_len:
                # the servers' context is max_prompt_len + agent.max_response_tokens: a longer
                # opening would be refused mid-trajectory
                raise ValueError(f"rollout.max_prompt_len: an opening conversation of environment {s.env!r} "
                                 f"(system prompt, tools, examples, question) is {len(prompt)} tokens, more than "
                                 f"{s.max_prompt_len}; raise rollout.max_prompt_len")
            send = functools.partial(self.manager.generate_one, job_index=job_index)
            while True:
                budget = s.max_response_tokens - len(traj)
                if info["turns"] >= s.max_turns or budget <= 0:
                    info["truncated"] = "max_turns" if info["turns"] >= s.max_turns else "token_budget"
                    finish = "length"
                    break
                params = dict(sampling, max_new_tokens=min(per_turn, budget))
                turn_seed = None if seed is None else (seed + info["turns"] * TURN_SEED_STRIDE) & 0x7FFFFFFF
                t = time.perf_counter()
                context = prompt + traj.ids
                out = await self._turn(send, context, params, turn_seed, covered if routed else None)
                clock.generate_s += time.perf_counter() - t
                if routed and out.output_ids:
                    pieces.extend(out.routes)
                    covered = len(context) + len(out.output_ids) - 1
                traj.add_model(out.output_ids, out.logprobs, out.versions if s.keep_versions else None)
                info["turns"] += 1
                t = time.perf_counter()
                text = self.tok.decode(out.output_ids, skip_special_tokens=True)
                texts.append(text)
                # a turn cut at max_new_tokens still goes to the environment: complete calls in it
                # run, and without one it is the (clipped) final answer, scored like a single turn
                calls, errors = self.parse(text)
                clock.tokenize_s += time.perf_counter() - t
                t = time.perf_counter()
                try:
                    res = await env.step(Action(text, calls, errors, out.finish_reason))
                except Exception as err:  # noqa: BLE001 - the environment failed (a sandbox crash): no reward, never 0
                    failure = failure_of(err, "env_error")
                    break
                finally:
                    clock.env_s += time.perf_counter() - t
                reward += res.reward
                for k in ("tool_calls", "tool_errors", "call_errors", "tool_timeouts"):
                    info[k] += int(res.info.get(k, 0))
                if res.truncated:
                    info["truncated"] = "tool_timeout" if res.info.get("tool_timeouts") else "env"
                    finish = "length"
                if res.done:
                    if out.finish_reason == "length" and not info["truncated"]:
                        info["truncated"], finish = "turn_length", "length"
                    break
                t = time.perf_counter()
                last = out.output_ids[-1] if out.output_ids and out.finish_reason == "stop" else None
                obs = self.turns.observation_ids(res.observations, last)
                clock.tokenize_s += time.perf_counter() - t
                if len(traj) + len(obs) >= s.max_response_tokens:
                    info["truncated"] = "token_budget"
                    finish = "length"
                    break
                traj.add_env(obs)
                info["env_tokens"] += len(obs)
        finally:
            await env.close()
            clock.trajectory_s += time.perf_counter() - started
        route_rows = joined_routes(pieces, covered, len(prompt) + len(traj), s.routes, s.routes_required) if routed else None
        sample = Sample(record, 0, prompt, traj.ids, traj.logprobs, finish, reward=reward, text=texts[-1] if texts else "",
                        versions=traj.versions, loss_mask=traj.mask, info=info, routed_experts=route_rows)
        if failure is not None:
            sample.fail(failure)
        return sample

    async def _turn(self, send: Callable, ids: list[int], params: dict[str, Any], seed: Optional[int],
                    routes_from: Optional[int] = None) -> Trajectory:
        """One model turn. Off-policy sources: resumable across pauses, with per-token weight
        versions; sync: one request (nothing pauses the servers while a sync batch generates).
        ``routes_from``: the routed experts of positions from there on come back too."""
        if self.s.keep_versions:
            out = await generate_resumable(send, ids, params, seed, routes_from)
            self.resumed += out.resumed
            return out
        if seed is not None:
            params = dict(params, sampling_seed=seed)
        got = await (send(ids, params) if routes_from is None else send(ids, params, routes_start=routes_from))
        if got.logprobs is None or len(got.logprobs) != len(got.output_ids):
            raise ValueError(f"a /generate answer has {len(got.output_ids)} tokens but "
                             f"{'no' if got.logprobs is None else len(got.logprobs)} logprobs")
        return Trajectory([int(t) for t in got.output_ids], [float(x) for x in got.logprobs], [], got.finish_reason,
                          routes=[got.routed_experts] if routes_from is not None else [])

    # ------------------------------------------------------------------ groups
    async def __call__(self, job: Any) -> list[Sample]:
        """``GroupRollout`` (off-policy sources): the n trajectories of one prompt."""
        return list(await asyncio.gather(*(self.trajectory(job.record, seed, job.job_index + k)
                                            for k, seed in enumerate(job.seeds))))

    async def _batch(self, records: list[Any], n: int, seed_base: Optional[int],
                     sampling: dict[str, Any], routes: bool = True) -> list[Sample]:
        jobs = []
        for p, rec in enumerate(records):
            for k in range(n):
                seed = None if seed_base is None else sample_seed(seed_base, p * n + k)
                jobs.append(self.trajectory(rec, seed, p * n + k, sampling, routes))
        samples = list(await asyncio.gather(*jobs))
        for i, smp in enumerate(samples):
            smp.group = i // n
        return samples

    def generate(self, records: list[Any], n: int, seed_base: Optional[int] = None, greedy: bool = False,
                 on_group: Optional[Callable[[list[Sample]], None]] = None) -> list[Sample]:
        """``n`` trajectories per record, all concurrently; group ``g`` = record ``g``."""
        sampling = dict(self.sampling)
        if greedy:
            sampling.update(temperature=0.0, top_p=1.0, top_k=-1)
        samples = self.manager.io.run(self._batch(records, n, seed_base, sampling, routes=not greedy))
        if on_group is not None:
            for g in range(len(records)):
                on_group(samples[g * n:(g + 1) * n])
        return samples

    def close(self) -> None:
        self.pool.close()


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Per batch: turns, tool calls and their success, tool errors and timeouts, truncations, and
    the share of response tokens the environment wrote."""
    infos = [s.info for s in samples if s.info]
    if not infos:
        return {}
    n = len(infos)
    calls = sum(i["tool_calls"] for i in infos)
    errors = sum(i["tool_errors"] for i in infos)            # malformed calls + calls that failed
    failed = sum(i.get("call_errors", 0) for i in infos)     # parsed calls that failed or timed out
    resp = sum(len(s.response_ids) for s in samples)
    out = {"agent/turns_mean": sum(i["turns"] for i in infos) / n,
           "agent/turns_max": float(max(i["turns"] for i in infos)),
           "agent/tool_calls_per_traj": calls / n,
           "agent/tool_call_success_frac": (calls - failed) / calls if calls else 0.0,
           "agent/tool_errors": float(errors),
           "agent/tool_timeouts": float(sum(i["tool_timeouts"] for i in infos)),
           "agent/truncated": float(sum(bool(i["truncated"]) for i in infos)),
           "agent/env_token_frac": sum(i["env_tokens"] for i in infos) / resp if resp else 0.0}
    for reason in ("max_turns", "token_budget", "turn_length", "tool_timeout"):
        out[f"agent/truncated_{reason}"] = float(sum(i["truncated"] == reason for i in infos))
    return out
