"""The RL loop as a phase sequencer (ARCHITECTURE.md, "The loop").

    rollout -> rewards -> old/ref logprobs, values -> advantages -> train -> sync -> checkpoint/eval

Everything heavy lives in the packages: ``workers/`` runs the Megatron ranks, ``rollout/`` turns
prompts into scored samples (``RolloutPipeline``) and hands out batches (a rollout source),
``algos/`` holds the math, ``sync/`` moves weights, ``checkpoint/`` saves and restores the parts
declared here. This module only decides what happens in which order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megarl.algos import LossSettings, get_advantage_estimator, kl_reward_penalty, make_kl_controller
from megarl.algos.distill import distilled_advantages
from megarl.algos.fidelity import LogprobBound, LogprobMismatch, logprob_bound, rollout_logprob_check
from megarl.algos.metrics import batch_summary
from megarl.checkpoint.hf_export import export_hf_folder, export_peft_adapter
from megarl.checkpoint.manager import CheckpointManager
from megarl.config import RunConfig
from megarl.config.served import resolve_served_defaults
from megarl.config.teacher import served_teacher_key
from megarl.data import PromptLoader, load_split
from megarl.data.images import check_images_fit_model
from megarl.data.batch import LOSS_MASK, TokenBatch
from megarl.data.packing import denominators
from megarl.errors import RunStopped
from megarl.metrics_log import MetricsLogger, PhaseTimer, note
from megarl.metrics_sinks import build_sinks
from megarl.models.routing_replay import agreement_metrics
from megarl.placement import RunPlacement
from megarl.placement.mps import MpsSession, start_mps
from megarl.profiling import phase_profiler
from megarl.rollout.agent import agent_metrics
from megarl.rollout.failures import FailedBatches, failure_metrics, valid_mask
from megarl.rollout.healing import RolloutServerLost
from megarl.rollout.ledger import LEDGER_FILE
from megarl.rollout.launch import RolloutServers, rollout_dtype
from megarl.rollout.pipeline import RolloutPipeline, build_pipeline
from megarl.rollout.routed_experts import moe_routing_shape
from megarl.rollout.sample import token_batch
from megarl.rollout.source import make_source
from megarl.rollout.teacher import ServedTeacher
from megarl.sync.driver import WeightSync
from megarl.watchdog import REQUEUE_EXIT, Watchdog
from megarl.wire.versions import version_tag
from megarl.workers.model_source import load_tokenizer, resolve_hf_path
from megarl.workers.residency import Residency, offload_switches
from megarl.workers.roles import start_roles
from megarl.workers.routing import merge_routing_stats

GROUP_FREE_ESTIMATORS = {"gae", "reinforce_plus_plus", "remax"}
__all__ = ["Trainer", "TrainerState", "LogprobMismatch"]


@dataclasses.dataclass
class TrainerState:
    """The trainer's own checkpointed state: step, KL coefficient, the driver's RNG."""

    step: int = 0
    kl_ctl: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "kl_coef": self.kl_ctl.value, "python_rng": random.getstate(),
                "torch_rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.kl_ctl.value = state["kl_coef"]
        random.setstate(_as_tuple(state["python_rng"]))
        torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))


class Trainer:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = Path(cfg.checkpoint.dir or self.out / "checkpoints")
        kl = cfg.algorithm.kl
        self.kl_ctl = make_kl_controller("adaptive" if kl.adaptive else "fixed", kl_coef=kl.coef,
                                         target_kl=kl.target, horizon=kl.horizon)
        self.state = TrainerState(kl_ctl=self.kl_ctl)
        self.checkpoints = CheckpointManager(self.ckpt_dir, cfg.checkpoint.keep_last)
        self.logprob_bound: Optional[LogprobBound] = None   # setup_data: depends on the served checkpoint
        self.first_step = 0   # the step this run starts at (a resumed run: the checkpoint's)
        self.groups: dict[str, Any] = {}               # role -> WorkerGroup
        self.servers: Optional[RolloutServers] = None
        self.weights: Optional[WeightSync] = None      # actor -> servers
        self.rollout: Optional[RolloutPipeline] = None
        self.source: Any = None                        # sync | one_step_off | async
        self.logger: Optional[MetricsLogger] = None
        self.residency = Residency({}, {}, cuda=False)   # what each role keeps on the GPU, phase by phase
        self.stop_requested = False
        self.preempted = False      # SIGTERM: stop at the next phase boundary
        self.mps: Optional[MpsSession] = None          # CUDA MPS daemon of a one-GPU disaggregated run
        self.failed_batches = FailedBatches(cfg.reward.max_failed_steps)   # batches without any reward, in a row
        self.served_teacher: Optional[ServedTeacher] = None   # teacher.mode served (megatron: groups["teacher"])
        log = cfg.logging
        self.profiler = phase_profiler(log.profile_steps, log.profile_phases, Path(log.profile_dir or self.out / "profile"))
        # phase deadlines: a hung phase names its rank, dumps every stack and exits for a requeue (watchdog.py)
        self.watchdog = Watchdog(cfg.watchdog, self.out / "watchdog", checkpoint=self._checkpoint_after_hang,
                                 close=self.close)

    # ------------------------------------------------------------------ set-up
    def setup_data(self) -> None:
        """Tokenizer, prompt splits and loader (no workers, no servers)."""
        cfg = self.cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
        note(f"run {cfg.name}: output in {self.out}")
        self.model_dir = resolve_hf_path(cfg.model.hf_path)
        # what the servers serve: the same checkpoint, or a copy in another format (block FP8)
        self.served_dir = resolve_hf_path(cfg.rollout.model_path) if cfg.rollout.model_path else self.model_dir
        fp8, fp8_note = resolve_served_defaults(cfg, str(self.served_dir))
        if fp8_note:
            note(fp8_note)
        self.logprob_bound = logprob_bound(cfg.model.dtype, rollout_dtype(cfg, fp8), cfg.rollout.logprob_diff_bound)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer or cfg.model.hf_path)
        self.train_records = load_split(cfg.data, cfg.seed, "train")
        self.eval_records = load_split(cfg.data, cfg.seed, "eval")
        check_images_fit_model(self.train_records + self.eval_records, self.model_dir, cfg.data.image_key)
        self.loader = PromptLoader(self.train_records, cfg.batch.prompts_per_step, cfg.seed, cfg.data.shuffle)
        self.moe_routing = moe_routing_shape(self.model_dir, cfg)
        note(f"data: {len(self.train_records)} train / {len(self.eval_records)} eval prompts")

    def setup_rollout(self, servers: RolloutServers) -> None:
        """The rollout pipeline over ``servers`` (restartable ones are healed through the weight sync)."""
        self.servers = servers
        self.rollout = build_pipeline(self.cfg, self.tokenizer, servers, self.moe_routing, self.reward_model_scores,
                                      self.weights.push_to_restarted if self.weights is not None else None)

    def setup(self) -> None:
        cfg = self.cfg
        self.setup_data()
        self.mps = start_mps(cfg, self.out, note)   # one shared GPU: before anything touches CUDA
        placement, started = RunPlacement(cfg), time.time()
        self.servers = servers = RolloutServers(cfg, self.served_dir, self.out / "logs", placement=placement.servers(),
                                                env=self.mps.env_for("rollout") if self.mps else None)
        self.groups = start_roles(cfg, placement)
        self.watchdog.arm(self.groups)
        if cfg.teacher.enabled and cfg.teacher.mode == "served":
            self.served_teacher = ServedTeacher(cfg.teacher.server_urls, cfg.teacher.request_batch,
                                                served_teacher_key(cfg), cfg.rollout.request_timeout_s,
                                                cfg.rollout.request_retries)
            self.served_teacher.wait_healthy()
        self.residency = Residency(self.groups, offload_switches(cfg, list(self.groups)), cfg.cluster.device == "cuda")
        servers.wait_healthy()
        note(f"workers and {len(servers.urls)} rollout server(s) ready in {time.time() - started:.1f}s")
        self.weights = WeightSync(cfg, self.groups["actor"], servers, self.served_dir)
        self.setup_rollout(servers)
        self.logger = MetricsLogger(None, cfg.trainer.total_steps, cfg.logging.progress_bar, sinks=build_sinks(cfg, self.out))
        self.source = self.make_source()
        self.checkpoints.register("trainer", self.state)
        self.checkpoints.register("rollout_source", self.source)   # loader position (and an off-policy buffer)
        for role in ("actor", "critic"):
            if role in self.groups:
                self.checkpoints.register_role(role, self.groups[role])
        resume = self.checkpoints.find(cfg.checkpoint.resume)
        if resume is not None:
            self.checkpoints.load(resume)
            note(f"resumed from {resume} at step {self.state.step}")
        self.first_step = self.state.step
        self.residency.hold("sync", "actor", "push")
        with self.watchdog.phase("sync", self.state.step):
            self.weights.push(version_tag(self.state.step))
        self.residency.release_all("rollout")
        if self.source.off_policy:
            self.source.set_version(self.state.step, taken_batches=self.state.step)

    def reward_model_scores(self, batch: TokenBatch) -> Any:
        """``reward.kind: model``: the reward model scores a rollout round where the servers' memory
        was (colocated GPU: they release it first; the next generation takes it back)."""
        self.rollout.server_memory("release")
        self.residency.hold("reward", "reward_model", "forward")
        scores = self.groups["reward_model"].forward("compute_scores", batch)["scores"]
        self.residency.release_all("rollout")
        return scores

    def make_source(self) -> Any:
        return make_source(self.cfg, self.rollout, self.train_records, self.loader, self.out / LEDGER_FILE)

    # ------------------------------------------------------------------ one RL step
    def step(self, step: int) -> dict[str, float]:
        a = self.cfg.algorithm
        timer = PhaseTimer(self._preemptible(step, self.watchdog.around(
            step + 1, functools.partial(self.profiler.phase, step + 1) if self.profiler else None)))
        manager = self.rollout.manager
        with timer("rollout"):
            restarted = manager.restarted
            samples, metrics = self.source.next_batch(step)   # sync: generated now; off-policy: from the buffer
            metrics["rollout/restarted_servers"] = manager.restarted - restarted
            metrics.update(agent_metrics(samples))
            baseline = self.rollout.greedy_baseline(samples) if a.advantage == "remax" else None
        with timer("release"):   # colocated GPU: the servers give their memory back (nothing else: ~0 s)
            self.rollout.server_memory("release")
        metrics.update(failure_metrics(samples))
        if not self.failed_batches.trainable(samples, step):   # no sample has a reward: weights stay, versions advance
            self._sync(step, timer, metrics)
            metrics["reward/all_failed_step"] = 1.0
            metrics.update(timer.metrics(0.0))
            return metrics

        batch = token_batch(samples, routes_shape=self.moe_routing)  # flat; [B, R] views only for the algorithms
        mask = batch.loss_mask()    # tokens the model sampled (agent: environment tokens are 0)
        fields = batch.token_fields
        actor = self.groups["actor"]
        # old_logprobs 'rollout': the servers' logprobs are the PPO ratio's denominator; the actor's
        # forward pass runs only at the run's first step (step 0 or the resumed one), for the
        # fidelity check -- which then also enforces its bound, the ratio resting on those logprobs
        rollout_lp_only = a.old_logprobs == "rollout"
        if not rollout_lp_only or step == self.first_step:
            with timer("old_logprobs"):
                self.residency.hold("old_logprobs", "actor", "forward")
                trainer_lp = actor.forward("compute_logprobs", batch, False, fields=tuple(batch.seq_fields))["logprobs"]
            if self.moe_routing is not None:
                metrics.update(agreement_metrics(merge_routing_stats(actor.call("routing_stats"))))
            checked, report = rollout_logprob_check(step, trainer_lp, fields["rollout_logprobs"],
                                                    fields.get(LOSS_MASK), self.logprob_bound,
                                                    enforce=step == 0 or rollout_lp_only)
            metrics.update(checked)
            if report:
                note(report)
        fields["old_logprobs"] = fields["rollout_logprobs"] if rollout_lp_only else trainer_lp
        token_weights = None
        if self.source.off_policy:   # staleness metrics; weights of tokens past the bound (stale_samples: downweight)
            found, token_weights = self.source.staleness(samples, batch, mask, step)
            metrics.update(found)
        kl_tokens = values = None
        if "ref" in self.groups:
            with timer("ref_logprobs"):
                self.residency.hold("ref_logprobs", "ref", "forward")
                fields["ref_logprobs"] = self.groups["ref"].forward("compute_logprobs", batch, False)["logprobs"]
            if a.kl.mode == "reward":
                kl_tokens = kl_reward_penalty(batch.padded(fields["old_logprobs"]), batch.padded(fields["ref_logprobs"]),
                                              mask, self.kl_ctl.value, a.kl.estimator)
        distilling = self.cfg.teacher.enabled
        if distilling:
            with timer("teacher_logprobs"):
                fields["teacher_logprobs"] = self.teacher_logprobs(batch)
        if "critic" in self.groups:
            with timer("values"):
                self.residency.hold("values", "critic", "forward")
                fields["old_values"] = self.groups["critic"].forward("compute_values", batch)["values"]
                values = batch.padded(fields["old_values"])

        rewards = torch.tensor([s.reward for s in samples])
        grouped = a.advantage not in GROUP_FREE_ESTIMATORS
        adv = get_advantage_estimator(a.advantage)(
            rewards, mask, group_ids=torch.tensor([s.group for s in samples]) if grouped else None, values=values,
            gamma=a.gamma, lam=a.lam, kl=kl_tokens, norm_std=a.norm_adv_by_std, baseline_rewards=baseline,
            valid=valid_mask(samples))   # failed samples: out of the advantage (and of the loss: their mask is 0)
        advantages = adv.advantages
        if distilling:   # on-policy distillation: the teacher's per-token signal beside (or instead of) the reward's
            advantages, found = self.distill(batch, advantages, mask)
            metrics.update(found)
        fields["advantages"] = batch.unpad(advantages if token_weights is None else advantages * token_weights)
        if values is not None:
            fields["returns"] = batch.unpad(adv.returns)
        if baseline is not None:
            metrics["remax/baseline_reward_mean"] = float(baseline.nanmean())   # nan: a greedy response failed

        with timer("train"):
            metrics.update(self.train(batch, mask, step))
        if a.kl.mode != "none" and "ref_logprobs" in fields:
            kl_now = float(((fields["old_logprobs"] - fields["ref_logprobs"]) * fields.get(LOSS_MASK, 1.0)).sum()
                           / mask.sum())
            self.kl_ctl.update(kl_now, len(batch))
            metrics.update({"kl/actor_ref_k1": kl_now, "kl/coef": self.kl_ctl.value})

        self._sync(step, timer, metrics)
        metrics.update(self.residency.metrics())
        metrics.update(batch_summary(rewards, torch.tensor([len(s.response_ids) for s in samples]),
                                     torch.tensor([s.finish_reason == "length" for s in samples]), advantages, mask,
                                     valid_mask(samples)))
        metrics.update(timer.metrics(float(mask.sum())))
        return metrics

    def _sync(self, step: int, timer: PhaseTimer, metrics: dict[str, float]) -> None:
        """The sync phase: the servers get version ``step + 1``."""
        with timer("sync"):   # wake order: server weights, the push, trainer state out, then the KV cache
            self.rollout.server_memory("resume", ("weights",))
            self.residency.hold("sync", "actor", "push")
            with self.source.weight_update(step + 1) as update:   # off-policy: pause or drain generation around it
                metrics.update(self.weights.push(version_tag(step + 1)))
            metrics.update(update)
            self.residency.release_all("rollout")
            self.rollout.server_memory("resume", ("kv_cache",))

    def teacher_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """The teacher's log-probabilities of the batch's response tokens: its Megatron role (which
        takes its parameters back on a colocated GPU) or its servers."""
        if self.served_teacher is not None:
            return self.served_teacher.logprobs(batch)
        self.residency.hold("teacher_logprobs", "teacher", "forward")
        return self.groups["teacher"].forward("compute_logprobs", batch, False)["logprobs"]

    def distill(self, batch: TokenBatch, task: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """``algorithm.distill`` over the batch's old and teacher log-probabilities (algos.distill)."""
        d, fields = self.cfg.algorithm.distill, batch.token_fields
        return distilled_advantages(task, batch.padded(fields["old_logprobs"]), batch.padded(fields["teacher_logprobs"]),
                                    mask, advantage=d.advantage, baseline=d.baseline, coef=d.coef,
                                    reward_weight=d.reward_weight)

    def train(self, batch: TokenBatch, mask: torch.Tensor, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over the batch's mini-batches: the actor, then the critic, on the
        same mini-batches (drawn per actor rank: each trains on its forward-pass range)."""
        cfg, a = self.cfg, self.cfg.algorithm
        fields = batch.token_fields
        loss = LossSettings.from_algorithm(a, cfg.rollout.sampling.max_new_tokens, self.kl_ctl.value)
        masked = (LOSS_MASK,) if LOSS_MASK in fields else ()
        actor_fields = ("old_logprobs", "advantages", "rollout_logprobs") + masked + tuple(batch.seq_fields) + (
            ("ref_logprobs",) if loss.kl_loss_coef and "ref_logprobs" in fields else ())
        metrics: dict[str, float] = {}
        for epoch in range(a.ppo_epochs):
            mbs = self.groups["actor"].minibatches(batch, cfg.batch.global_batch_size, cfg.seed + step * 101 + epoch)
            dens = denominators(mask, mbs.minibatches)
            self.residency.hold("train", "actor", "train")
            metrics.update(_prefixed(self.groups["actor"].train(batch, mbs, dens, loss, actor_fields), "actor/"))
            if "critic" in self.groups:
                self.residency.hold("train", "critic", "train")
                metrics.update(_prefixed(self.groups["critic"].train(batch, mbs, dens, loss, ("old_values", "returns")
                                                                     + masked), "critic/"))
        return metrics

    # ------------------------------------------------------------------ evaluation, checkpoints, export
    def evaluate(self) -> dict[str, float]:
        with self.watchdog.phase("eval", self.state.step):
            return self.rollout.evaluate(self.eval_records)

    def save_checkpoint(self) -> Path:
        with self.watchdog.phase("checkpoint", self.state.step):
            path = self.checkpoints.save(self.state.step)
        note(f"checkpoint {path}")
        return path

    def _checkpoint_after_hang(self, phase: str) -> Path:
        """The watchdog's checkpoint after a hang in a phase that leaves the ranks idle (rollout,
        release, eval): the last finished step, a hung rollout's batch given back to the source so
        that the resume redoes the step."""
        if phase != "eval":
            self.source.rewind_batch()
        return self.checkpoints.save(self.state.step)

    def export_hf(self) -> Path:
        out = export_hf_folder(self.groups["actor"], self.model_dir, self.out / "hf_export")   # LoRA: merged
        note(f"exported HF model to {out}")
        if self.cfg.actor.lora.rank:
            adapter = export_peft_adapter(self.groups["actor"], self.cfg.actor.lora, self.model_dir, self.out / "hf_adapter")
            note(f"exported PEFT adapter to {adapter}")
        return out

    # ------------------------------------------------------------------ run
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        results: dict[str, Any] = {"steps": []}
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            handlers = {signal.SIGUSR1: signal.signal(signal.SIGUSR1, self._on_time_limit),
                        signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_preemption)}
        try:
            self.setup()
            if cfg.trainer.eval_before_after and self.state.step == 0:
                results["eval_before"] = self._log_eval("before")
            while self.state.step < cfg.trainer.total_steps:
                self._stop_if_preempted("the next step")
                metrics = self._step_or_checkpoint(self.state.step)
                self.state.step += 1
                results["steps"].append(metrics)
                self.logger.log(self.state.step, metrics, console=self.state.step % cfg.logging.log_interval == 0)
                self._stop_if_preempted("the step's eval and checkpoint")
                if cfg.trainer.eval_interval and self.state.step % cfg.trainer.eval_interval == 0:
                    self.logger.log(self.state.step, self.evaluate())
                if cfg.checkpoint.interval and self.state.step % cfg.checkpoint.interval == 0:
                    self.save_checkpoint()
                if self.stop_requested:
                    self._final_checkpoint()
                    results["stopped_early"] = self.state.step
                    return results
            if cfg.trainer.eval_before_after:
                results["eval_after"] = self._log_eval("after")
            self._final_checkpoint()
            if cfg.checkpoint.export_hf:
                results["export"] = str(self.export_hf())
            return results
        finally:
            self.watchdog.settle()   # after a hang the watchdog ends the process, with the requeue code
            self.close()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)

    def _log_eval(self, when: str) -> dict[str, float]:
        found = self.evaluate()
        self.logger.log(self.state.step, found, console=False)
        note(f"eval {when}: {found}")
        return found

    def _final_checkpoint(self) -> None:
        if not self.cfg.checkpoint.final:
            return
        if not self.cfg.checkpoint.interval or self.state.step % self.cfg.checkpoint.interval:
            self.save_checkpoint()

    def _on_time_limit(self, signum: int, frame: Any) -> None:
        """SIGUSR1 (SLURM's ``--signal=B:USR1@300`` before the time limit): finish the current
        step, write a checkpoint and stop, so the requeued job resumes where this one ended."""
        note("SIGUSR1: checkpoint after this step, then stop")
        self.stop_requested = True

    def _on_preemption(self, signum: int, frame: Any) -> None:
        """SIGTERM (a SLURM preemption, ``scancel``; SIGKILL follows after the cluster's grace
        time): the phase running now -- a weight push, a checkpoint write -- finishes, no new one
        starts, and the run ends with the requeue exit code. The resume starts from the newest
        checkpoint; the prompt ledger shows no prompt lost or repeated."""
        if not self.preempted:
            note("SIGTERM: stopping at the next phase boundary (the running phase finishes)")
        self.preempted = True

    def _stop_if_preempted(self, before: str) -> None:
        if self.preempted:
            newest = self.checkpoints.find("auto")
            raise RunStopped(f"stopped by SIGTERM after step {self.state.step}, before {before}; "
                             + (f"checkpoint.resume=auto resumes from {newest}" if newest else "no checkpoint yet")
                             + f" (exit code {REQUEUE_EXIT}: launch/slurm requeues the job)", REQUEUE_EXIT)

    def _preemptible(self, step: int, around: Any) -> Any:
        """A ``PhaseTimer`` hook that stops a preempted run before each phase of ``step`` starts."""
        @contextlib.contextmanager
        def phase(name: str) -> Any:
            self._stop_if_preempted(f"step {step + 1}'s {name} phase")
            with around(name) if around else contextlib.nullcontext():
                yield
        return phase

    def _step_or_checkpoint(self, step: int) -> dict[str, float]:
        """One step; when a rollout server is lost for good, a checkpoint of the last finished step
        (the source rewound to this step's start, so a resume redoes it) before the error."""
        try:
            return self.step(step)
        except RolloutServerLost as e:
            self.source.rewind_batch()
            path = self.save_checkpoint()
            raise RolloutServerLost(f"step {step}: {e}; checkpoint of step {self.state.step} written to {path} "
                                    f"(resume with checkpoint.resume=auto)") from e

    def close(self) -> None:
        """Stop everything that was started."""
        self.watchdog.stop()
        for part in (self.source, self.logger, self.weights, self.served_teacher):
            if part is not None:
                part.close()
        for group in self.groups.values():
            group.shutdown()
        self.groups = {}
        if self.servers is not None:
            self.servers.stop()
        if self.rollout is not None:
            self.rollout.close()
        RunPlacement.shutdown(self.cfg)
        if self.mps is not None:
            self.mps.stop()


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {(k if k.startswith(prefix) else prefix + k): v for k, v in metrics.items()}


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list) else x
