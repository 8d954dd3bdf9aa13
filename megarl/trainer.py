"""The RL loop, readable top to bottom (DESIGN.md, "The loop").

    prompts -> rollout (SGLang API) -> rewards -> filters -> old/ref logprobs, values
            -> advantages -> actor/critic updates (Megatron) -> weight sync -> log, checkpoint

Everything heavy lives elsewhere: workers/ runs Megatron ranks, rollout/ talks to servers, algos/
holds the math, sync/ moves weights. This module only decides what happens in which order.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megarl.checkpoint.atomic import replace_dir
from megarl.config import RunConfig, load_config, validate_config
from megarl.data.batch import LOSS_MASK, TokenBatch
from megarl.data.packing import cut, minibatch_sizes
from megarl.metrics_log import MetricsLogger, note
from megarl.rollout.sample import Sample  # noqa: F401  (a trajectory; re-exported, it lived here)
from megarl.wire.versions import version_tag

GROUP_FREE_ESTIMATORS = {"gae", "reinforce_plus_plus", "remax"}


class LogprobMismatch(RuntimeError):
    """Rollout and trainer disagree on the sampled tokens' logprobs: wrong weights or naming."""


@dataclass
class TrainerState:
    step: int = 0
    loader: dict[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------

def export_hf_shard(worker: Any, out_dir: str) -> dict[str, str]:
    """Each sender rank writes the HF tensors it owns into its own safetensors file."""
    from safetensors.torch import save_file

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in worker.iter_hf_weights()}
    if not tensors:
        return {}
    file_name = f"model-rank{worker.spec.rank:05d}.safetensors"
    save_file(tensors, os.path.join(out_dir, file_name), metadata={"format": "pt"})
    return {name: file_name for name in tensors}


def export_hf_folder(group: Any, model_dir: Path, out: Path, config_updates: Optional[dict] = None) -> Path:
    """Write a role's weights as an HF folder (sharded safetensors written by the ranks that own
    them, index, config.json, tokenizer files); replaced atomically."""
    tmp = out.with_name("." + out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    for part in group.call("call", export_hf_shard, str(tmp)):
        weight_map.update(part)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    config = json.loads((model_dir / "config.json").read_text())
    config.update(config_updates or {})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "vocab", "merges", "chat_template")):
            shutil.copy(f, tmp / f.name)
    replace_dir(tmp, out)
    note(f"exported HF model to {out}")
    return out


def token_batch(samples: list[Sample], with_rollout_logprobs: bool = True,
                routes_shape: Optional[tuple[int, int]] = None) -> TokenBatch:
    """The step's samples as flat tensors (the one layout every worker call ships, DESIGN.md);
    MoE rollouts' routed experts ride along as a sequence field when any sample has them, agent
    trajectories' loss mask (1 model token, 0 environment token) as a token field."""
    fields = {"rollout_logprobs": [s.rollout_logprobs for s in samples]} if with_rollout_logprobs else {}
    if any(s.loss_mask for s in samples):   # agent trajectories: environment tokens are not trained on
        fields[LOSS_MASK] = [s.loss_mask or [1] * len(s.response_ids) for s in samples]
    batch = TokenBatch.from_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], fields or None)
    if routes_shape is not None and any(s.routed_experts is not None for s in samples):
        from megarl.rollout.routed_experts import flat_routes
        from megarl.workers.routing import ROUTES_KEY

        batch.seq_fields[ROUTES_KEY] = flat_routes([s.routed_experts for s in samples],
                                                   batch.seq_lens.tolist(), routes_shape)
    return batch


def minibatches(num_samples: int, global_batch_size: int, seed: int) -> list[list[int]]:
    """Shuffled mini-batches of whole samples; a short tail joins the last mini-batch. (The step
    draws them per data-parallel rank, ``WorkerGroup.minibatches``; at dp 1 that is this.)"""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    return cut(order, minibatch_sizes(num_samples, global_batch_size))


def denominators(mask: torch.Tensor, batches: list[list[int]]) -> list[dict[str, float]]:
    return [{"num_tokens": float(mask[b].sum().clamp(min=1)), "num_seqs": float(len(b))} for b in batches]


# ---------------------------------------------------------------------------------------------
# the trainer
# ---------------------------------------------------------------------------------------------

class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir or self.out / "checkpoints")
        self.state = TrainerState(kl_coef=cfg.algorithm.kl.coef)
        self.groups: dict[str, Any] = {}
        self.servers = None
        self.logger: Optional[MetricsLogger] = None

    # ------------------------------------------------------------------ set-up
    def setup_data(self) -> None:
        """Tokenizer, prompt splits, loader and reward function (no workers, no servers)."""
        from megarl.algos import make_kl_controller
        from megarl.data import PromptLoader, load_split
        from megarl.rewards import RewardPool, build_reward_fn
        from megarl.workers.model_source import load_tokenizer, resolve_hf_path

        cfg = self.cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(__import__("dataclasses").asdict(cfg), indent=1))
        note(f"run {cfg.name}: output in {self.out}")
        self.model_dir = resolve_hf_path(cfg.model.hf_path)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_path)
        self.train_records = load_split(cfg.data, cfg.seed, "train")
        self.eval_records = load_split(cfg.data, cfg.seed, "eval")
        self.loader = PromptLoader(self.train_records, cfg.batch.prompts_per_step, cfg.seed, cfg.data.shuffle)
        self.reward_fn = build_reward_fn(cfg.reward) if cfg.reward.kind != "model" else None
        self.reward_pool = (RewardPool(self.reward_fn, cfg.reward.workers, cfg.reward.executor)
                            if self.reward_fn is not None else None)
        from megarl.rollout.routed_experts import moe_routing_shape

        self.moe_routing = moe_routing_shape(self.model_dir, cfg)
        kl = cfg.algorithm.kl
        self.kl_ctl = make_kl_controller("adaptive" if kl.adaptive else "fixed", kl_coef=kl.coef,
                                         target_kl=kl.target, horizon=kl.horizon)
        note(f"data: {len(self.train_records)} train / {len(self.eval_records)} eval prompts")

    def setup(self) -> None:
        cfg = self.cfg
        self.setup_data()
        backend = cfg.cluster.backend
        placement_groups: dict[str, Any] = {}
        if backend == "ray":
            from megarl.placement import create_placement_groups, init_ray, plan_pools

            init_ray(cfg)
            pools = plan_pools(cfg)
            placement_groups = create_placement_groups(pools)
        t0 = time.time()
        self.servers = self._start_servers(placement_groups)
        from megarl.workers import WorkerGroup

        roles = [("actor", True, False), ("ref", False, False), ("critic", True, True), ("reward_model", False, True)]
        for role, trainable, value_head in roles:
            if not getattr(cfg, role).enabled:
                continue
            pg, share = None, 1.0
            if backend == "ray":
                from megarl.placement import plan_pools, pool_of

                pool = pool_of(plan_pools(cfg), role)
                pg = placement_groups[pool.name]
                share = 0.9 / len(pool.roles)  # the rest of a shared bundle is for a rollout server
            group = WorkerGroup(role, cfg, backend=backend, trainable=trainable, value_head=value_head,
                                placement_group=pg, share=share)
            info = group.call("setup")
            note(f"{role}: {cfg_role_layout(getattr(cfg, role))}, {info[0]['params'] / 1e6:.1f}M params on rank 0")
            self.groups[role] = group
        self.servers.wait_healthy()
        note(f"workers and {len(self.servers.urls)} rollout server(s) ready in {time.time() - t0:.1f}s")
        from megarl.metrics_sinks import build_sinks

        self.logger = MetricsLogger(None, cfg.trainer.total_steps, cfg.logging.progress_bar,
                                    sinks=build_sinks(cfg, self.out))
        self.source = self._make_source()
        self._maybe_resume()
        self._push_weights(version=version_tag(self.state.step))
        if self.source.off_policy:
            self.source.set_version(self.state.step, taken_batches=self.state.step)

    def _make_source(self):
        """Where batches come from (``rollout.mode``; megarl/rollout/source.py)."""
        from megarl.rollout.source import OffPolicySource, SingleTurnRollout, SyncSource

        cfg, r = self.cfg, self.cfg.rollout
        if r.mode == "sync":
            return SyncSource(self.collect, lambda: self._manager.retried if hasattr(self, "_manager") else 0,
                              self.loader)
        from megarl.data import PromptLoader

        manager = self._rollout_manager()
        ds = cfg.algorithm.dynamic_sampling
        rollout = self._agent(keep_versions=True) if cfg.agent.enabled else SingleTurnRollout(
            manager, self._sampling(greedy=False), lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            self.score, self.moe_routing, cfg.algorithm.routing_replay == "rollout")
        return OffPolicySource(
            mode=r.mode, rollout=rollout, loader=PromptLoader(self.train_records, 1, cfg.seed, cfg.data.shuffle),
            records={rec.index: rec for rec in self.train_records}, encode=self._prompt_ids, n=r.n_per_prompt,
            groups_per_batch=cfg.batch.prompts_per_step, max_staleness=r.max_staleness, interrupt=r.interrupt,
            stale=r.stale_samples, group_seed=lambda step: self._seed_base(step, 0), call_servers=manager.call_all,
            run=manager.io.run, submit=manager.io.submit,
            dynamic_sampling_rounds=ds.max_rounds if ds.enabled else None, ledger=self.out / "rollout_ledger.jsonl")

    def _start_servers(self, placement_groups: dict[str, Any]):
        """Servers go to the rollout pool (disaggregated) or the shared one (colocated) under Ray."""
        from megarl.rollout.launch import RolloutServers

        pg = placement_groups.get("rollout") or placement_groups.get("shared")
        return RolloutServers(self.cfg, self.model_dir, self.out / "logs", placement=(pg, 0) if pg else None)

    def _maybe_resume(self) -> None:
        resume = self.cfg.checkpoint.resume
        if resume == "none":
            return
        path = Path(resume) if resume != "auto" else latest_checkpoint(self.ckpt_dir)
        if path is None:
            return
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"checkpoint.resume: {path} is not a megarl checkpoint (no trainer_state.json)")
        state = json.loads((path / "trainer_state.json").read_text())
        for role in ("actor", "critic"):
            if role in self.groups:
                self.groups[role].call("load_checkpoint", str(path / role))
        self.state.step = state["step"]
        self.source.load_state_dict(state)   # the loader's position (and an off-policy source's buffer)
        self.kl_ctl.value = state["kl_coef"]
        random.setstate(tuple(_as_tuple(state["python_rng"])))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))
        note(f"resumed from {path} at step {self.state.step}")

    # ------------------------------------------------------------------ rollout
    def _prompt_ids(self, rec: Any) -> Optional[list[int]]:
        """A record's prompt tokens, or None (with a note) when longer than rollout.max_prompt_len."""
        from megarl.data import encode_prompt

        cfg, r = self.cfg, self.cfg.rollout
        ids = encode_prompt(self.tokenizer, rec, chat_template=cfg.data.chat_template, system_prompt=cfg.data.system_prompt)
        if len(ids) > r.max_prompt_len:
            note(f"prompt {rec.index} has {len(ids)} tokens > rollout.max_prompt_len {r.max_prompt_len}: dropped")
            return None
        return ids

    def _sampling(self, greedy: bool) -> dict[str, Any]:
        r = self.cfg.rollout
        stop = sorted(set(r.sampling.stop_token_ids) | {t for t in [self.tokenizer.eos_token_id] if t is not None})
        return {"max_new_tokens": r.sampling.max_new_tokens, "temperature": 0.0 if greedy else r.sampling.temperature,
                "top_p": 1.0 if greedy else r.sampling.top_p, "top_k": -1 if greedy else r.sampling.top_k,
                "stop_token_ids": stop}

    def _rollout_manager(self):
        if not hasattr(self, "_manager"):
            from megarl.rollout.manager import RolloutManager

            r = self.cfg.rollout
            self._manager = RolloutManager(self.servers.urls, max_concurrency=r.max_running_requests,
                                           timeout_s=r.request_timeout_s, request_retries=r.request_retries,
                                           api_key=self.servers.api_key, healer=self._healer())
        return self._manager

    def _agent(self, keep_versions: bool = False):
        """The agent loop (``agent.enabled``): multi-turn trajectories through the rollout manager."""
        if not hasattr(self, "_agent_rollout"):
            from megarl.rollout.agent import AgentRollout, AgentSettings

            a = self.cfg.agent
            settings = AgentSettings(a.env, dict(a.env_args), a.tool_parser, a.max_turns, a.max_response_tokens,
                                     a.tool_timeout_s, a.tool_workers, keep_versions, self.moe_routing,
                                     self.cfg.algorithm.routing_replay == "rollout", self.cfg.rollout.max_prompt_len)
            self._agent_rollout = AgentRollout(self._rollout_manager(), self._sampling(greedy=False), self.tokenizer,
                                               settings)
        return self._agent_rollout

    def _seed_base(self, step: int, rounds: int) -> int:
        """Sampling seed of a step's rollout round (each request adds its index, manager.sample_seed)."""
        return (self.cfg.seed * 1_000_003 + step * 1009 + rounds) & 0x7FFFFFFF

    def generate(self, records: list[Any], n: int, greedy: bool = False, seed_base: int = 0,
                 on_group: Optional[Callable[[list[Sample]], None]] = None) -> list[Sample]:
        """``n`` samples per record, in record order. ``on_group`` (e.g. ``score``) is called on each
        group's samples as soon as its request completes, while the rest still generate. With
        ``agent.enabled`` each sample is a multi-turn trajectory scored by its environment."""
        if self.cfg.agent.enabled:
            return self._agent().generate(records, n, None if greedy else seed_base, greedy, on_group)
        from megarl.rollout.routed_experts import sample_routes

        prompts, kept = [], []
        for rec in records:
            ids = self._prompt_ids(rec)
            if ids is not None:
                prompts.append(ids)
                kept.append(rec)
        routes = self.moe_routing is not None and not greedy
        replay = self.cfg.algorithm.routing_replay == "rollout"
        groups: list[list[Sample]] = [[] for _ in prompts]
        for g, outs in self._rollout_manager().stream(prompts, n=n, sampling=self._sampling(greedy),
                                                      seed=None if greedy else seed_base, return_routed_experts=routes):
            rec, ids = kept[g], prompts[g]
            for out in outs:
                response = list(out.output_ids)
                text = self.tokenizer.decode(response, skip_special_tokens=True)
                groups[g].append(Sample(rec, g, ids, response, list(out.logprobs or []), out.finish_reason, text=text,
                                        routed_experts=sample_routes(out.routed_experts, len(ids) + len(response),
                                                                     self.moe_routing, replay) if routes else None))
            if on_group is not None:
                on_group(groups[g])
        return [s for group in groups for s in group]

    def score(self, samples: list[Sample]) -> None:
        """Rewards (plus DAPO overlong shaping when enabled); agent trajectories already carry their
        environment's reward."""
        from megarl.algos import overlong_penalty

        if self.cfg.agent.enabled:
            return

        if self.reward_fn is None:  # reward.kind = model: the reward-model role scores whole sequences
            eos = self.tokenizer.eos_token_id
            trimmed = [Sample(s.record, s.group, s.prompt_ids,
                              s.response_ids[:-1] if len(s.response_ids) > 1 and s.response_ids[-1] == eos else s.response_ids,
                              [], s.finish_reason) for s in samples]
            scores = self.groups["reward_model"].forward("compute_scores", token_batch(trimmed, False))["scores"]
            for s, score in zip(samples, scores.tolist()):
                s.reward = float(score)
        else:  # parallel workers, order kept: a slow user function must not serialise the batch
            for s, reward in zip(samples, self.reward_pool.score([s.text for s in samples],
                                                                 [s.record for s in samples])):
                s.reward = reward
        o = self.cfg.algorithm.overlong
        if o.enabled:
            lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float32)
            penalty = overlong_penalty(lengths, self.cfg.rollout.sampling.max_new_tokens, o.buffer_len, o.penalty_factor)
            for s, p in zip(samples, penalty.tolist()):
                s.reward += p

    def collect(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Rollout + reward for one step; with DAPO dynamic sampling, keep drawing prompts until
        ``prompts_per_step`` groups with non-identical rewards are collected (or rounds run out)."""
        cfg = self.cfg
        n = cfg.rollout.n_per_prompt
        ds = cfg.algorithm.dynamic_sampling
        kept: list[Sample] = []
        rounds, drawn = 0, 0
        while True:
            records = self.loader.next_batch()
            # rule/function rewards score each group as it arrives, overlapping the generation
            # tail; a reward model scores the whole batch in one call afterwards
            inline = self.reward_fn is not None
            samples = self.generate(records, n, seed_base=self._seed_base(step, rounds),
                                    on_group=self.score if inline else None)
            if not inline:
                self.score(samples)
            drawn += len(records)
            rounds += 1
            if not ds.enabled:
                kept = samples
                break
            for group in _groups(samples):
                rewards = {s.reward for s in group}
                if len(rewards) > 1 and len(kept) // n < cfg.batch.prompts_per_step:
                    kept.extend(group)
            if len(kept) // n >= cfg.batch.prompts_per_step or rounds >= ds.max_rounds:
                break
        if not kept:
            raise RuntimeError(f"step {step}: dynamic sampling kept no group in {rounds} rounds (all rewards equal)")
        # renumber groups contiguously
        regrouped, mapping = [], {}
        for s in kept:
            key = (id(s.record), s.group)
            mapping.setdefault(key, len(mapping))
            s.group = mapping[key]
            regrouped.append(s)
        return regrouped, {"rollout/rounds": rounds, "rollout/prompts_drawn": drawn,
                           "rollout/groups_kept": len(mapping)}

    def greedy_baseline(self, samples: list[Sample]) -> torch.Tensor:
        """ReMax's baseline: the reward of one greedy response per prompt, for each sample."""
        firsts: dict[int, Sample] = {}
        for s in samples:
            firsts.setdefault(s.group, s)
        groups = sorted(firsts)
        greedy = self.generate([firsts[g].record for g in groups], 1, greedy=True)
        self.score(greedy)
        reward_of = {g: r.reward for g, r in zip(groups, greedy)}
        return torch.tensor([reward_of[s.group] for s in samples])

    # ------------------------------------------------------------------ one RL step
    def step(self, step: int) -> dict[str, float]:
        from megarl.algos import get_advantage_estimator, kl_reward_penalty

        cfg, a = self.cfg, self.cfg.algorithm
        times: dict[str, float] = {}
        t = time.time()
        restarted = self._manager.restarted if hasattr(self, "_manager") else 0
        samples, metrics = self.source.next_batch(step)   # sync: generated now; off-policy: from the buffer
        metrics["rollout/restarted_servers"] = self._manager.restarted - restarted  # dead/hung, restarted
        if self.cfg.agent.enabled:
            from megarl.rollout.agent import agent_metrics

            metrics.update(agent_metrics(samples))   # turns, tool calls/errors/timeouts, truncations
        times["rollout"] = time.time() - t
        self._rollout_memory("release")
        rewards = torch.tensor([s.reward for s in samples])
        resp_lens = [len(s.response_ids) for s in samples]
        batch = token_batch(samples, routes_shape=self.moe_routing)  # flat; [B, R] views only for the algorithms
        mask = batch.loss_mask()    # response tokens the model sampled (agent: environment tokens are 0)
        fields = batch.token_fields
        masked = (LOSS_MASK,) if LOSS_MASK in fields else ()
        routes = tuple(batch.seq_fields)  # MoE: the rollout's experts, for replay and agreement (R3)

        t = time.time()
        actor = self.groups["actor"]
        fields["old_logprobs"] = actor.forward("compute_logprobs", batch, False, fields=routes)["logprobs"]
        times["old_logprobs"] = time.time() - t
        if self.moe_routing is not None:
            from megarl.models.routing_replay import agreement_metrics
            from megarl.workers.routing import collect_routing_stats, merge_routing_stats

            metrics.update(agreement_metrics(merge_routing_stats(actor.call("call", collect_routing_stats))))
        metrics.update(self._check_logprobs(step, fields["old_logprobs"], fields["rollout_logprobs"], fields.get(LOSS_MASK)))
        stale_weights = self._staleness(samples, batch, mask, step, metrics) if self.source.off_policy else None
        kl_tokens = None
        if "ref" in self.groups:
            t = time.time()
            fields["ref_logprobs"] = self.groups["ref"].forward("compute_logprobs", batch, False)["logprobs"]
            times["ref_logprobs"] = time.time() - t
            if a.kl.mode == "reward":
                kl_tokens = kl_reward_penalty(batch.padded(fields["old_logprobs"]), batch.padded(fields["ref_logprobs"]),
                                              mask, self.kl_ctl.value, a.kl.estimator)
        values = None
        if "critic" in self.groups:
            t = time.time()
            fields["old_values"] = self.groups["critic"].forward("compute_values", batch)["values"]
            values = batch.padded(fields["old_values"])
            times["values"] = time.time() - t

        group_size = None if a.advantage in GROUP_FREE_ESTIMATORS else cfg.rollout.n_per_prompt
        group_ids = None if group_size is None else torch.tensor([s.group for s in samples])
        baseline = self.greedy_baseline(samples) if a.advantage == "remax" else None
        if baseline is not None:
            metrics["remax/baseline_reward_mean"] = float(baseline.mean())
        adv = get_advantage_estimator(a.advantage)(
            rewards, mask, group_ids=group_ids, values=values, gamma=a.gamma, lam=a.lam, kl=kl_tokens,
            norm_std=a.norm_adv_by_std, baseline_rewards=baseline)
        fields["advantages"] = batch.unpad(adv.advantages if stale_weights is None else adv.advantages * stale_weights)
        if values is not None:
            fields["returns"] = batch.unpad(adv.returns)

        t = time.time()
        algo = {"policy_loss": a.policy_loss, "entropy_coef": a.entropy_coef, "value_clip": a.value_clip,
                "kl_loss_coef": self.kl_ctl.value if a.kl.mode == "loss" else 0.0, "kl_estimator": a.kl.estimator,
                "agg_mode": a.loss_agg,
                "policy_loss_cfg": {"clip_low": a.clip_low, "clip_high": a.clip_high, "dual_clip_c": a.dual_clip_c,
                                    "agg_mode": a.loss_agg, "tis_cap": a.tis_cap,
                                    "norm_len": float(cfg.rollout.sampling.max_new_tokens)}}
        for epoch in range(a.ppo_epochs):
            # drawn per actor rank: each trains on its forward-pass range (shards are views, no gather)
            mbs = actor.minibatches(batch, cfg.batch.global_batch_size, cfg.seed + step * 101 + epoch)
            dens = denominators(mask, mbs.minibatches)
            actor_fields = ("old_logprobs", "advantages", "rollout_logprobs") + masked + routes + (
                ("ref_logprobs",) if algo["kl_loss_coef"] and "ref_logprobs" in fields else ())
            metrics.update(_prefixed(actor.train(batch, mbs, dens, algo, actor_fields), "actor/"))
            if "critic" in self.groups:
                critic = self.groups["critic"]
                metrics.update(_prefixed(critic.train(batch, mbs, dens, algo, ("old_values", "returns") + masked), "critic/"))
        times["train"] = time.time() - t
        if a.kl.mode != "none" and "ref_logprobs" in fields:
            flat_mask = fields[LOSS_MASK] if masked else torch.ones_like(fields["old_logprobs"])
            kl_now = float(((fields["old_logprobs"] - fields["ref_logprobs"]) * flat_mask).sum() / mask.sum())
            metrics["kl/actor_ref_k1"] = kl_now
            self.kl_ctl.update(kl_now, len(batch))
            metrics["kl/coef"] = self.kl_ctl.value

        t = time.time()
        self._rollout_memory("resume")
        with self.source.weight_update(step + 1) as update:   # off-policy: pause or drain generation around it
            sync = self._push_weights(version=version_tag(step + 1))
        times["sync"] = time.time() - t
        metrics.update(sync)
        metrics.update(update)

        tokens = float(mask.sum())
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
            "reward/max": float(rewards.max()), "reward/min": float(rewards.min()),
            "response/length_mean": sum(resp_lens) / len(resp_lens), "response/length_max": max(resp_lens),
            "response/clipped_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "advantage/mean": float((adv.advantages * mask).sum() / mask.sum().clamp(min=1)),
            "batch/samples": len(samples), "batch/response_tokens": tokens,
        })
        for phase, seconds in times.items():
            metrics[f"time/{phase}_s"] = seconds
        metrics["time/step_s"] = sum(times.values())
        for phase in ("rollout", "old_logprobs", "train"):
            metrics[f"throughput/{phase}_tokens_per_s"] = tokens / max(times[phase], 1e-9)
        return metrics

    def _check_logprobs(self, step: int, trainer_lp: torch.Tensor, rollout_lp: torch.Tensor,
                        loss_mask: Optional[torch.Tensor] = None) -> dict[str, float]:
        """Rollout vs trainer logprobs of the sampled tokens; at step 0 a mean difference above the
        dtype-calibrated bound (megarl/algos/fidelity.py) stops the run: the servers do not hold the
        trainer's weights. The report names the bound and the noise floor it came from."""
        from megarl.algos.fidelity import logprob_bound, mean_abs_diff
        from megarl.rollout.launch import rollout_dtype

        cfg = self.cfg
        # flat: response tokens only; of an agent trajectory, only the model's (environment tokens have no rollout logprob)
        mean, worst = mean_abs_diff(trainer_lp, rollout_lp, torch.ones_like(trainer_lp) if loss_mask is None else loss_mask)
        bound = logprob_bound(cfg.model.dtype, rollout_dtype(cfg), cfg.rollout.logprob_diff_bound)
        out = {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": worst}
        if step == 0:
            out.update({"rollout/logprob_diff_bound": bound.bound, "rollout/logprob_noise_floor": bound.floor})
            verdict = "exceeds" if mean > bound.bound else "within"
            note(f"step 0: mean |rollout - trainer| logprob = {mean:.3g} (max {worst:.3g}) {verdict} the "
                 f"{bound.describe()}")
            if mean > bound.bound:
                raise LogprobMismatch(
                    f"step 0: mean |rollout - trainer| logprob = {mean:.4g} exceeds the {bound.describe()}: the "
                    f"rollout servers do not hold the trainer's weights (wrong checkpoint, naming or dtype); a "
                    f"correct run differs by about the noise floor, a wrong weight by order 1")
        return out
    def _staleness(self, samples: list[Sample], batch: TokenBatch, mask: torch.Tensor, step: int,
                   metrics: dict[str, float]) -> Optional[torch.Tensor]:
        """Off-policy batches: staleness metrics (the trainer holds version ``step``), rollout vs
        trainer logprobs of fresh and stale tokens and, with ``rollout.stale_samples: downweight``,
        per-token weights for tokens past the bound."""
        from megarl.algos.offpolicy import logprob_diff_by_staleness, staleness_stats, staleness_weights

        r = self.cfg.rollout
        versions = batch.padded(torch.tensor([v for s in samples for v in s.versions], dtype=torch.int64))
        metrics.update({f"offpolicy/{k}": v for k, v in staleness_stats(versions, mask, step).items()})
        lp = batch.token_fields
        metrics.update({f"offpolicy/{k}": v for k, v in logprob_diff_by_staleness(
            versions, mask, step, batch.padded(lp["old_logprobs"]), batch.padded(lp["rollout_logprobs"])).items()})
        bound = 1 if r.mode == "one_step_off" else r.max_staleness
        if r.stale_samples != "downweight":
            return None
        weights = staleness_weights(versions, mask, step, bound, r.stale_weight)
        metrics["offpolicy/downweighted_token_frac"] = float(((weights < 1) & mask.bool()).sum() / mask.sum().clamp(min=1))
        return weights

    def _rollout_memory(self, action: str) -> None:
        """Colocated on GPU: rollout servers give their KV cache and weights back to the trainer
        while it trains (SGLang's release/resume_memory_occupation), and take them back before the
        weight push. Disaggregated or CPU runs keep the servers as they are."""
        if self.cfg.placement.mode != "colocated" or self.cfg.cluster.device != "cuda" or not hasattr(self, "_manager"):
            return
        self._manager.call_all(f"{action}_memory_occupation")

    def _push_target(self):
        from megarl.sync.rank import PushTarget, checkpoint_names, run_transport

        cfg = self.cfg
        transport = run_transport(cfg)
        return PushTarget(urls=tuple(self.servers.urls), server_tp_sizes=tuple(self.servers.tp_sizes),
                          transport=transport,
                          backend="nccl" if cfg.cluster.device == "cuda" else "gloo", bucket_mb=cfg.sync.bucket_mb,
                          verify_checksum=cfg.sync.verify_checksum, disk_dir=str(self.servers.weights_dir),
                          api_key=self.servers.api_key, timeout_s=cfg.rollout.request_timeout_s,
                          known_names=checkpoint_names(str(self.model_dir)), ipc_groups=self._ipc_groups(transport))

    def _ipc_groups(self, transport: str) -> Optional[tuple]:
        """Colocated tensor transport into servers megarl started on the actor's own bundles: which
        actor ranks hand each server TP rank a copy on its GPU (None: the sender's memory, e.g.
        servers given by URL)."""
        from megarl.sync.colocated import ipc_groups_for

        r = self.cfg.rollout
        if transport != "tensor" or self.cfg.placement.mode != "colocated" or r.server_urls:
            return None
        if sum(self.servers.tp_sizes) != self.cfg.actor.gpus:
            return None
        return ipc_groups_for(self.servers.tp_sizes)

    def _push_weights(self, version: str = "init") -> dict[str, float]:
        """One weight-update session on every server around all actor ranks' pushes."""
        from megarl.sync.rank import push_from_rank
        from megarl.sync.session import weight_update_session

        if not hasattr(self, "_target"):
            self._target = self._push_target()
        with weight_update_session(self.servers.urls, api_key=self.servers.api_key):
            stats = self.groups["actor"].call("call", push_from_rank, self._target, version)
        self._weight_version = version
        groups = sorted({(s["group"], s.get("master")) for s in stats if s.get("group")})
        if groups != getattr(self, "sync_groups", None):
            self.sync_groups = groups
            note("weight sync: " + ", ".join(f"{g}" + (f" (master {m})" if m else "") for g, m in groups)
                 + f" -> {len(self.servers.urls)} server(s), TP {list(self.servers.tp_sizes)}")
        total_bytes = sum(s.get("bytes", 0) for s in stats)
        seconds = max((s.get("seconds", 0.0) for s in stats), default=0.0)
        return {"sync/bytes": float(total_bytes), "sync/seconds": float(seconds),
                "sync/bytes_per_s": float(total_bytes / seconds) if seconds else 0.0}

    def _healer(self):
        """Restarts for servers megarl started (None for rollout.server_urls: not ours to restart)."""
        from megarl.rollout.healing import ServerHealer

        if not self.servers.restartable:
            return None
        return ServerHealer(self.servers, self._push_to_restarted, self.cfg.rollout.max_restarts)

    def _push_to_restarted(self, server: int) -> None:
        """The current weights into restarted server ``server`` (new URL), through a session on it
        alone and a fresh update group per stage for it alone; the run's own update groups held the
        old process, so they are left and made again at the next push (with the new URL)."""
        from megarl.sync.rank import close_pusher, push_to_server
        from megarl.sync.session import weight_update_session

        actor = self.groups["actor"]
        actor.call("call", close_pusher)
        self._target = self._push_target()
        self._heals = getattr(self, "_heals", 0) + 1
        with weight_update_session([self.servers.urls[server]], api_key=self.servers.api_key):
            actor.call("call", push_to_server, self._target, getattr(self, "_weight_version", "init"), server,
                       f"heal{self._heals}")

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        if not self.eval_records:
            return {}
        samples = self.generate(self.eval_records, 1, greedy=True)
        self.score(samples)
        rewards = [s.reward for s in samples]
        return {"eval/reward_mean": sum(rewards) / len(rewards),
                "eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                "eval/response_length": sum(len(s.response_ids) for s in samples) / len(samples)}

    # ------------------------------------------------------------------ checkpoints & export
    def save_checkpoint(self) -> Path:
        step = self.state.step
        final = self.ckpt_dir / f"step_{step:06d}"
        tmp = self.ckpt_dir / f".tmp_step_{step:06d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for role in ("actor", "critic"):
            if role in self.groups:
                self.groups[role].call("save_checkpoint", str(tmp / role))
        state = {"step": step, **self.source.state_dict(), "kl_coef": self.kl_ctl.value,
                 "python_rng": random.getstate(), "torch_rng": torch.get_rng_state().tolist()}
        (tmp / "trainer_state.json").write_text(json.dumps(state))
        replace_dir(tmp, final)  # a checkpoint is either whole or absent
        prune_checkpoints(self.ckpt_dir, self.cfg.checkpoint.keep_last)
        note(f"checkpoint {final}")
        return final

    def export_hf(self) -> Path:
        return export_hf_folder(self.groups["actor"], self.model_dir, self.out / "hf_export")

    # ------------------------------------------------------------------ run
    def _on_time_limit(self, signum: int, frame: Any) -> None:
        """SIGUSR1 (SLURM's ``--signal=B:USR1@300`` before the time limit): finish the current
        step, write a checkpoint and stop, so the requeued job resumes where this one ended."""
        note("SIGUSR1: checkpoint after this step, then stop")
        self._stop_requested = True

    def run(self) -> dict[str, Any]:
        import signal
        import threading

        cfg = self.cfg
        results: dict[str, Any] = {"steps": []}
        self._stop_requested = False
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_time_limit)
        try:
            self.setup()
            if cfg.trainer.eval_before_after and self.state.step == 0:
                results["eval_before"] = self.evaluate()
                self.logger.log(0, results["eval_before"], console=False)
                note(f"eval before: {results['eval_before']}")
            while self.state.step < cfg.trainer.total_steps:
                metrics = self._step_or_checkpoint(self.state.step)
                self.state.step += 1
                results["steps"].append(metrics)
                self.logger.log(self.state.step, metrics, console=self.state.step % cfg.logging.log_interval == 0)
                if cfg.trainer.eval_interval and self.state.step % cfg.trainer.eval_interval == 0:
                    self.logger.log(self.state.step, self.evaluate())
                if cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0:
                    self.save_checkpoint()
                if self._stop_requested:
                    if not cfg.checkpoint.interval or self.state.step % cfg.checkpoint.interval:
                        self.save_checkpoint()
                    results["stopped_early"] = self.state.step
                    return results
            if cfg.trainer.eval_before_after:
                results["eval_after"] = self.evaluate()
                self.logger.log(self.state.step, results["eval_after"], console=False)
                note(f"eval after: {results['eval_after']}")
            if not cfg.checkpoint.interval or self.state.step % cfg.checkpoint.interval:
                self.save_checkpoint()
            if cfg.checkpoint.export_hf:
                results["export"] = str(self.export_hf())
            return results
        finally:
            self.close()

    def _step_or_checkpoint(self, step: int) -> dict[str, float]:
        """One step; when a rollout server is lost for good, a checkpoint of the last finished step
        (the source rewound to this step's start: its prompts, or its batch back in the buffer, so
        a resume redoes it) before the error."""
        from megarl.rollout.healing import RolloutServerLost

        try:
            return self.step(step)
        except RolloutServerLost as e:
            self.source.rewind_batch()
            path = self.save_checkpoint()
            raise RolloutServerLost(f"step {step}: {e}; checkpoint of step {self.state.step} written to {path} "
                                    f"(resume with checkpoint.resume=auto)") from e

    def close(self) -> None:
        if getattr(self, "source", None) is not None:
            self.source.close()
        if self.logger is not None:
            self.logger.close()
        if getattr(self, "reward_pool", None) is not None:
            self.reward_pool.close()
        if "actor" in self.groups:
            from megarl.sync.rank import close_pusher

            try:
                self.groups["actor"].call("call", close_pusher)
            except Exception as e:  # a failed worker must not keep the others from shutting down
                note(f"closing weight-sync connections failed: {type(e).__name__}: {e}")
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        if self.servers is not None:
            self.servers.stop()
        if hasattr(self, "_agent_rollout"):
            self._agent_rollout.close()
        if hasattr(self, "_manager"):
            self._manager.close()
        if self.cfg.cluster.backend == "ray" and not self.cfg.cluster.ray_address:
            import ray

            if ray.is_initialized():
                ray.shutdown()


def cfg_role_layout(role: Any) -> str:
    p = role.parallel
    return f"{role.gpus} rank(s) tp{p.tp} pp{p.pp}" + (f" ep{p.ep}" if p.ep > 1 else "")


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints (``keep_last`` 0: keep every one);
    returns what was deleted. The newest is never deleted: it was just written."""
    if keep_last <= 0:
        return []
    old = sorted(ckpt_dir.glob("step_*"))[:-keep_last]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def latest_checkpoint(ckpt_dir: Path) -> Optional[Path]:
    found = sorted(ckpt_dir.glob("step_*")) if ckpt_dir.is_dir() else []
    return found[-1] if found else None


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    by: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        by.setdefault((id(s.record), s.group), []).append(s)
    return list(by.values())


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {(k if k.startswith(prefix) else prefix + k): v for k, v in metrics.items()}


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list) else x


def train_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megarl train", description="run RL training from a recipe")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=5")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)
    validate_config(cfg, check_paths=True)
    if cfg.trainer.mode == "reward_model":
        from megarl.reward_model_trainer import RewardModelTrainer

        results = RewardModelTrainer(cfg).run()
    else:
        results = Trainer(cfg).run()
    summary = {k: v for k, v in results.items() if k != "steps"}
    summary["final_step"] = results["steps"][-1] if results["steps"] else {}
    print(json.dumps(summary, default=float))
    return 0
