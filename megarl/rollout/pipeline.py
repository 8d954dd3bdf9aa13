"""The rollout phase: prompts in, scored samples out, for every mode and every kind of rollout.

One object answers everything the loop needs from rollout servers:

* :meth:`RolloutPipeline.collect` -- a sync step's batch: the step's prompts, ``n`` samples each,
  scored as each group completes; with DAPO dynamic sampling, more prompts until enough groups
  carry a signal (the group filter is ``algos.filters.group_has_signal``, the one used by the
  off-policy sources too);
* :meth:`RolloutPipeline.group_rollout` -- the per-group coroutine an off-policy source runs
  (single-turn: ``SingleTurnRollout``; agent: ``AgentRollout``, or ``ByoAgentRollout`` for a
  user's own agent behind the OpenAI-compatible gateway), built from the same settings;
* greedy jobs that need the servers: :meth:`evaluate` (held-out accuracy) and
  :meth:`greedy_baseline` (ReMax), run inside the rollout phase, before servers release memory.

Single-turn samples go out as batched ``/generate`` requests (``RolloutManager.stream``: one
request per chunk of groups, so a prompt is prefilled once); agent trajectories run turn by turn
through the agent loop. Either way the result is a list of :class:`Sample`, grouped by prompt.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megarl.algos import overlong_penalty
from megarl.algos.filters import group_has_signal
from megarl.data import encode_prompt
from megarl.metrics_log import note
from megarl.rewards import RewardPool, build_reward_fn
from megarl.rewards.failures import Failure, checked_score
from megarl.rollout.agent import AgentRollout, AgentSettings
from megarl.rollout.byo_agent import ByoAgentRollout, ByoSettings
from megarl.rollout.call_session import CallLimits
from megarl.rollout.failures import valid_rewards
from megarl.rollout.healing import ServerHealer
from megarl.rollout.judge import build_judge
from megarl.rollout.manager import RolloutManager
from megarl.rollout.routed_experts import sample_routes
from megarl.rollout.sample import Sample, token_batch
from megarl.rollout.source import SingleTurnRollout

# reward model: scores of whole sequences (the reward-model role's forward pass)
ScoreSequences = Callable[[Any], torch.Tensor]


class SampleScorer:
    """Rewards of finished samples: a rule/function reward (in a worker pool, order kept), a judge
    model (``rollout/judge.py``; the same ``score(texts, records)`` as the pool) or the reward-model
    role, plus DAPO's overlong shaping. A sample the scorer could not score is marked failed
    (``Sample.fail``: reward nan, never 0). Agent trajectories carry their environment's reward
    already and are left as they are."""

    def __init__(self, cfg: Any, reward_pool: Any = None, score_sequences: Optional[ScoreSequences] = None,
                 eos_token_id: Optional[int] = None):
        if (reward_pool is None) == (score_sequences is None) and not cfg.agent.enabled:
            raise ValueError("a scorer needs exactly one of a reward pool (function or judge) and a reward model")
        self.cfg = cfg
        self.pool, self.score_sequences, self.eos = reward_pool, score_sequences, eos_token_id

    @property
    def inline(self) -> bool:
        """Rule/function rewards score each group as it arrives (overlapping the generation tail);
        a reward model scores the whole batch in one call afterwards."""
        return self.pool is not None

    def __call__(self, samples: list[Sample]) -> None:
        if self.cfg.agent.enabled:
            return
        if self.pool is None:   # reward.kind = model: whole sequences, without the closing EOS
            trimmed = [Sample(s.record, s.group, s.prompt_ids,
                              s.response_ids[:-1] if len(s.response_ids) > 1 and s.response_ids[-1] == self.eos
                              else s.response_ids, [], s.finish_reason) for s in samples]
            scores = [checked_score(x) for x in self.score_sequences(token_batch(trimmed, False)).tolist()]
        else:
            scores = self.pool.score([s.text for s in samples], [s.record for s in samples])
        for s, score in zip(samples, scores):
            if isinstance(score, Failure):
                s.fail(score)
            else:
                s.reward = float(score)
        o = self.cfg.algorithm.overlong
        if o.enabled:
            lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
            penalty = overlong_penalty(lengths, self.cfg.rollout.sampling.max_new_tokens, o.buffer_len, o.penalty_factor)
            for s, p in zip(samples, penalty.tolist()):
                s.reward += p   # a failed sample stays nan

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


class RolloutPipeline:
    def __init__(self, cfg: Any, tokenizer: Any, manager: Any, scorer: SampleScorer,
                 moe_routing: Optional[tuple[int, int]] = None):
        self.cfg, self.tokenizer, self.manager, self.scorer = cfg, tokenizer, manager, scorer
        self.moe_routing = moe_routing            # MoE (layers, top_k) when the rollout records routes
        self.replay_routes = cfg.algorithm.routing_replay == "rollout"
        self.agent = self._agent_rollout(keep_versions=cfg.rollout.mode != "sync") if cfg.agent.enabled else None
        self.released: set[str] = set()           # memory the servers gave back (colocated GPU)

    # ------------------------------------------------------------------ settings
    def prompt_ids(self, rec: Any) -> Optional[list[int]]:
        """A record's prompt tokens, or None (with a note) when longer than rollout.max_prompt_len."""
        cfg = self.cfg
        ids = encode_prompt(self.tokenizer, rec, chat_template=cfg.data.chat_template,
                            system_prompt=cfg.data.system_prompt)
        if len(ids) > cfg.rollout.max_prompt_len:
            note(f"prompt {rec.index} has {len(ids)} tokens > rollout.max_prompt_len {cfg.rollout.max_prompt_len}: dropped")
            return None
        return ids

    def sampling(self, greedy: bool) -> dict[str, Any]:
        s = self.cfg.rollout.sampling
        stop = sorted(set(s.stop_token_ids) | {t for t in [self.tokenizer.eos_token_id] if t is not None})
        return {"max_new_tokens": s.max_new_tokens, "temperature": 0.0 if greedy else s.temperature,
                "top_p": 1.0 if greedy else s.top_p, "top_k": -1 if greedy else s.top_k, "stop_token_ids": stop}

    def seed_base(self, step: int, rounds: int) -> int:
        """Sampling seed of a step's rollout round (each request adds its index, manager.sample_seed)."""
        return (self.cfg.seed * 1_000_003 + step * 1009 + rounds) & 0x7FFFFFFF

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ group rollouts
    def _agent_rollout(self, keep_versions: bool):
        a = self.cfg.agent
        if a.entrypoint is not None:   # bring your own agent: the user's function behind the gateway
            return self._byo_rollout(keep_versions)
        settings = AgentSettings(a.env, dict(a.env_args), a.tool_parser, a.max_turns, a.max_response_tokens,
                                 a.tool_timeout_s, a.tool_workers, keep_versions, self.moe_routing,
                                 self.replay_routes, self.cfg.rollout.max_prompt_len)
        return AgentRollout(self.manager, self.sampling(greedy=False), self.tokenizer, settings)

    def _byo_rollout(self, keep_versions: bool) -> ByoAgentRollout:
        a, r = self.cfg.agent, self.cfg.rollout
        limits = CallLimits(a.max_turns, a.max_response_tokens, r.sampling.max_new_tokens, r.max_prompt_len)
        settings = ByoSettings(a.entrypoint, a.tool_parser, limits, a.trajectory_timeout_s, a.concurrency, a.segments,
                               keep_versions, a.gateway_host, a.gateway_port,
                               entrypoint_args=dict(a.entrypoint_args))
        pool = self.scorer.pool
        return ByoAgentRollout(self.manager, self.sampling(greedy=False), self.tokenizer, settings,
                               pool.score if pool is not None else None)

    def group_rollout(self) -> Any:
        """The coroutine an off-policy source runs per group: the agent loop, or the n resumable
        single-turn samples of one prompt, scored in a thread."""
        if self.agent is not None:
            return self.agent
        return SingleTurnRollout(self.manager, self.sampling(greedy=False), self.decode, self.scorer,
                                 self.moe_routing, self.replay_routes)

    # ------------------------------------------------------------------ generation
    def generate(self, records: list[Any], n: int, greedy: bool = False, seed_base: int = 0,
                 on_group: Optional[Callable[[list[Sample]], None]] = None) -> list[Sample]:
        """``n`` samples per record, in record order. ``on_group`` (e.g. the scorer) is called on
        each group as soon as its request completes, while the rest still generate. Servers that
        gave their memory back take it again first (a dynamic-sampling round after a reward-model
        pass, eval)."""
        self.server_memory("resume")
        if self.agent is not None:
            return self.agent.generate(records, n, None if greedy else seed_base, greedy, on_group)
        prompts, kept = [], []
        for rec in records:
            ids = self.prompt_ids(rec)
            if ids is not None:
                prompts.append(ids)
                kept.append(rec)
        routes = self.moe_routing is not None and not greedy
        groups: list[list[Sample]] = [[] for _ in prompts]
        for g, outs in self.manager.stream(prompts, n=n, sampling=self.sampling(greedy),
                                           seed=None if greedy else seed_base, return_routed_experts=routes):
            rec, ids = kept[g], prompts[g]
            for out in outs:
                response = list(out.output_ids)
                groups[g].append(Sample(rec, g, ids, response, list(out.logprobs or []), out.finish_reason,
                                        text=self.decode(response),
                                        routed_experts=sample_routes(out.routed_experts, len(ids) + len(response),
                                                                     self.moe_routing, self.replay_routes)
                                        if routes else None))
            if on_group is not None:
                on_group(groups[g])
        return [s for group in groups for s in group]

    def collect(self, loader: Any, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout + reward for one sync step; with DAPO dynamic sampling, keep drawing prompts
        until ``prompts_per_step`` groups carry a signal (or the rounds run out)."""
        cfg = self.cfg
        n, want = cfg.rollout.n_per_prompt, cfg.batch.prompts_per_step
        ds = cfg.algorithm.dynamic_sampling
        kept: list[list[Sample]] = []
        rounds, drawn = 0, 0
        while True:
            records = loader.next_batch()
            samples = self.generate(records, n, seed_base=self.seed_base(step, rounds),
                                    on_group=self.scorer if self.scorer.inline else None)
            if not self.scorer.inline:
                self.scorer(samples)
            drawn += len(records)
            rounds += 1
            groups = _groups(samples)
            if not ds.enabled:
                kept = groups
                break
            kept += [g for g in groups if group_has_signal(valid_rewards(g))][: want - len(kept)]
            if len(kept) >= want or rounds >= ds.max_rounds:
                break
        if not kept:
            raise RuntimeError(f"step {step}: dynamic sampling kept no group in {rounds} rounds (all rewards equal)")
        out = []
        for g, group in enumerate(kept):   # groups renumbered contiguously
            for s in group:
                s.group = g
                out.append(s)
        return out, {"rollout/rounds": rounds, "rollout/prompts_drawn": drawn, "rollout/groups_kept": len(kept)}

    # ------------------------------------------------------------------ greedy jobs
    def greedy_baseline(self, samples: list[Sample]) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, for each sample."""
        firsts: dict[int, Sample] = {}
        for s in samples:
            firsts.setdefault(s.group, s)
        groups = sorted(firsts)
        greedy = self.generate([firsts[g].record for g in groups], 1, greedy=True)
        self.scorer(greedy)
        reward_of = {g: r.reward for g, r in zip(groups, greedy)}
        return torch.tensor([reward_of[s.group] for s in samples])

    def evaluate(self, records: list[Any]) -> dict[str, float]:
        """Held-out reward, accuracy (reward >= 1) and response length of greedy answers; reward
        and accuracy over the answers that could be scored (``eval/failed_frac`` counts the rest)."""
        if not records:
            return {}
        samples = self.generate(records, 1, greedy=True)
        self.scorer(samples)
        rewards = valid_rewards(samples)
        scored = max(1, len(rewards))
        return {"eval/reward_mean": sum(rewards) / scored,
                "eval/accuracy": sum(r >= 1.0 for r in rewards) / scored,
                "eval/failed_frac": 1.0 - len(rewards) / len(samples),
                "eval/response_length": sum(len(s.response_ids) for s in samples) / len(samples)}

    def shares_gpus(self) -> bool:
        """Servers and Megatron roles on the same GPUs (colocated on CUDA)."""
        return self.cfg.placement.mode == "colocated" and self.cfg.cluster.device == "cuda"

    def server_memory(self, action: str, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Colocated on GPU: the servers give their KV cache and weights back while the trainer
        works (SGLang's release/resume_memory_occupation with tags, ``action`` release | resume).
        Wake order before a push (slime's): weights, the push, then the KV cache, so the push's
        buckets never meet a full KV pool. Only what changes is sent (SGLang refuses to release
        twice). Disaggregated or CPU runs keep the servers as they are."""
        if not self.shares_gpus():
            return
        todo = [t for t in tags if (t in self.released) == (action == "resume")]
        if not todo:
            return
        self.manager.call_all(f"{action}_memory_occupation", todo)
        if action == "release":
            self.released.update(todo)
        else:
            self.released.difference_update(todo)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.scorer.close()
        self.manager.close()


def build_pipeline(cfg: Any, tokenizer: Any, servers: Any, moe_routing: Optional[tuple[int, int]],
                   reward_model_scores: ScoreSequences,
                   push_to_restarted: Optional[Callable[[int], None]] = None) -> RolloutPipeline:
    """The run's pipeline over ``servers``: a manager that heals restartable servers (pushing the
    current weights into a restarted one through ``push_to_restarted``) and the configured reward
    (a function pool, or ``reward_model_scores`` for ``reward.kind: model``)."""
    r = cfg.rollout
    healer = (ServerHealer(servers, push_to_restarted, r.max_restarts)
              if servers.restartable and push_to_restarted is not None else None)
    manager = RolloutManager(servers.urls, max_concurrency=r.max_running_requests, timeout_s=r.request_timeout_s,
                             request_retries=r.request_retries, api_key=servers.api_key, healer=healer,
                             lora_name=lambda: getattr(servers, "lora_name", None),
                             coalesce_max_samples=r.coalesce_max_samples)
    model_reward = cfg.reward.kind == "model"
    scorer = SampleScorer(cfg, None if model_reward else reward_pool(cfg), reward_model_scores if model_reward else None,
                          tokenizer.eos_token_id)
    return RolloutPipeline(cfg, tokenizer, manager, scorer, moe_routing)


def reward_pool(cfg: Any) -> Any:
    """What scores a run's samples batch by batch (``score(texts, records)``, ``close()``): the judge
    server for ``reward.kind: judge``, else the reward function in its worker pool."""
    r = cfg.reward
    if r.kind == "judge":
        return build_judge(cfg, Path(cfg.output_dir) / "logs")
    return RewardPool(build_reward_fn(r), r.workers, r.executor, r.retries, r.timeout_s)


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Samples by (record, group), in first-seen order."""
    by: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        by.setdefault((id(s.record), s.group), []).append(s)
    return list(by.values())
