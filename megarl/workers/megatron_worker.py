"""One Megatron rank of a role (actor, critic, reference, reward model).

The same class runs as a Ray actor (one per GPU/CPU rank) or in-process (backend ``local``).
Every public method is called on *all* ranks of the role at once by a ``WorkerGroup``; each rank
takes its data-parallel share of the batch, runs megatron's pipeline schedule over micro-batches
(fixed size or a token budget), and ranks on the last pipeline stage with tp_rank 0 return the
results for their share, which the group reassembles in the original order.

Loss scaling: megatron's schedule divides each micro-batch loss by the number of micro-batches and
DDP averages gradients over data-parallel ranks. RL losses need *global* denominators (tokens or
sequences of the whole mini-batch), which the driver computes once; the loss handed to megatron is
``loss(global denominators) * num_microbatches * dp`` so that, after megatron's own scaling, the
summed gradient is exactly the gradient of the mini-batch loss.

Fewer samples than data-parallel ranks (dynamic sampling that gave up early can leave a mini-batch
smaller than dp): a rank with an empty share still runs one micro-batch of a real sample with its
loss multiplied by zero, so it joins every collective of the step (the gradient all-reduce, TP/PP
exchanges, MoE all-to-alls over the expert-data-parallel group) and adds exactly nothing; it
returns no per-sample results and no loss metrics.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megarl.models.builder import unwrap
from megarl.workers.batch import (SequenceBatch, pad_inputs, response_positions, split_by_token_budget,
                                  split_fixed)
from megarl.workers.routing import routing_flags, set_batch_routes, trainer_fp32_lm_head
from megarl.workers.vocab_parallel import logprobs_and_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerSpec:
    """Everything a rank needs to start, picklable for Ray."""

    role: str                  # actor | critic | ref | reward_model
    cfg: Any                   # RunConfig
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    trainable: bool
    value_head: bool


class MegatronWorker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.cfg = spec.cfg
        self.role_cfg = getattr(spec.cfg, spec.role)
        self.chunks: list[torch.nn.Module] = []
        self.optimizer = None
        self.scheduler = None
        self.steps = 0

    # ------------------------------------------------------------------ set-up
    def setup(self) -> dict[str, Any]:
        from megarl.parallel import apply_cpu_shim, init_distributed, init_model_parallel

        spec, p = self.spec, self.role_cfg.parallel
        os.environ.update({"RANK": str(spec.rank), "WORLD_SIZE": str(spec.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port)})
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        if self.cfg.cluster.device == "cpu":
            apply_cpu_shim()
        else:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        init_distributed()
        from megatron.core import parallel_state as mpu

        # Backend 'local' hosts several one-rank roles in one process: they share one layout.
        if not (mpu.model_parallel_is_initialized() and torch.distributed.get_world_size() == 1):
            init_model_parallel(tp=p.tp, pp=p.pp, vpp=p.vpp if p.vpp > 1 else None, ep=p.ep, etp=p.etp, cp=p.cp,
                                seed=self.cfg.seed)
        self._seed(self.cfg.seed)
        from megarl.models import build_model, load_hf_weights

        path = self._model_path()
        dtype = DTYPES[self.cfg.model.dtype]
        self.hf_dir = path
        self.chunks = build_model(str(path), value_head=self.spec.value_head, params_dtype=dtype,
                                  vpp=p.vpp if p.vpp > 1 else None, fp32_lm_head=trainer_fp32_lm_head(self.cfg))
        if self.cfg.cluster.device == "cuda":
            self.chunks = [c.cuda() for c in self.chunks]
        for chunk in self.chunks:
            chunk.config.variable_seq_lengths = True  # micro-batches pad to their own length
        if self.cfg.model.megatron_checkpoint and self.spec.role in ("actor", "ref"):
            from megarl.checkpoint import load_megatron

            load_megatron(self.chunks, self.cfg.model.megatron_checkpoint)
        else:
            load_hf_weights(self.chunks, str(path))
        if self.spec.trainable:
            self._setup_optimizer()
        else:
            for chunk in self.chunks:
                chunk.eval()
        return {"rank": spec.rank, "role": spec.role, "params": sum(x.numel() for c in self.chunks for x in c.parameters())}

    def _model_path(self) -> Path:
        from megarl.workers.model_source import resolve_hf_path

        own = self.role_cfg.model_path
        return resolve_hf_path(own or self.cfg.model.hf_path)

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        torch.manual_seed(seed)

    def _setup_optimizer(self) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.role_cfg.optim
        # megatron's DistributedOptimizer type-checks for torch.cuda tensors; on CPU (tests, CI)
        # the plain optimizer is used: same math, optimizer states not sharded over dp. With one
        # data-parallel rank there is nothing to shard either (and its checkpoint path failed on
        # one GPU: "Param id ... does not match any model sharded param"; see the closing note).
        from megatron.core import parallel_state as mpu

        use_dist_opt = (o.distributed_optimizer and self.cfg.cluster.device == "cuda"
                        and mpu.get_data_parallel_world_size() > 1)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=use_dist_opt)
        self.chunks = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in self.chunks]
        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        bf16 = self.cfg.model.dtype == "bfloat16"
        opt_cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                                  adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                                  clip_grad=o.clip_grad, use_distributed_optimizer=use_dist_opt,
                                  bf16=bf16, params_dtype=DTYPES[self.cfg.model.dtype])
        self.optimizer = get_megatron_optimizer(opt_cfg, self.chunks)
        total = max(1, self.cfg.trainer.total_steps * self._optimizer_steps_per_rl_step())
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=total,
            lr_decay_style=o.lr_decay, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=total, wd_incr_style="constant")

    def _optimizer_steps_per_rl_step(self) -> int:
        samples = self.cfg.batch.prompts_per_step * self.cfg.rollout.n_per_prompt
        return max(1, samples // self.cfg.batch.global_batch_size) * self.cfg.algorithm.ppo_epochs

    # ------------------------------------------------------------------ topology
    def topology(self) -> dict[str, int]:
        from megatron.core import parallel_state as mpu

        return {"rank": self.spec.rank, "dp_rank": mpu.get_data_parallel_rank(), "dp": mpu.get_data_parallel_world_size(),
                "tp_rank": mpu.get_tensor_model_parallel_rank(), "pp_rank": mpu.get_pipeline_model_parallel_rank(),
                "is_output": int(self._is_output_rank())}

    def _is_output_rank(self) -> bool:
        from megatron.core import parallel_state as mpu

        return (mpu.is_pipeline_last_stage(ignore_virtual=True) and mpu.get_tensor_model_parallel_rank() == 0
                and mpu.get_context_parallel_rank() == 0)

    def _dp_share(self, n: int) -> list[int]:
        from megatron.core import parallel_state as mpu

        dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        return list(range(rank, n, dp))

    @staticmethod
    def _filler(batch: SequenceBatch, index: list[int]) -> SequenceBatch:
        """One real sample for a rank whose share is empty: it runs through the schedule (so the
        rank joins the collectives) and its loss is multiplied by zero."""
        return batch.select(index[:1])

    def _micro_batches(self, batch: SequenceBatch) -> list[list[int]]:
        budget = self.role_cfg.max_tokens_per_micro_batch
        if budget:
            return split_by_token_budget([len(s) for s in batch.sequences], budget)
        return split_fixed(len(batch), self.role_cfg.micro_batch_size)

    # ------------------------------------------------------------------ schedule
    def _run_schedule(self, micro: list[SequenceBatch], per_output: Callable, forward_only: bool) -> list[Any]:
        """Run megatron's forward(-backward) schedule; ``per_output(output, mb) -> (loss, data)``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = torch.device("cuda") if self.cfg.cluster.device == "cuda" else torch.device("cpu")
        prepared = []
        for mb in micro:
            ids, pos = pad_inputs(mb)
            prepared.append((mb, ids.to(device), pos.to(device)))
        routing = routing_flags(self.spec.role, self.cfg, forward_only)

        def step(data_iter, model):
            mb, ids, pos = next(data_iter)
            set_batch_routes(model, mb, tuple(ids.shape), **routing)  # MoE: rollout's experts (R3)
            output = model(ids, pos, None)

            def loss_func(output_tensor, non_loss_data=False):
                loss, data = per_output(output_tensor, mb)
                if forward_only:
                    return data if non_loss_data else (torch.zeros((), device=device), data)
                return loss, data
            return output, loss_func

        chunks = self.chunks
        iters = [iter(prepared) for _ in chunks] if len(chunks) > 1 else iter(prepared)
        seq_len = max(ids.shape[1] for _, ids, _ in prepared)
        fb = get_forward_backward_func()
        return fb(forward_step_func=step, data_iterator=iters, model=chunks if len(chunks) > 1 else chunks[0],
                  num_microbatches=len(prepared), seq_length=seq_len, micro_batch_size=1,
                  forward_only=forward_only, collect_non_loss_data=forward_only)

    def _token_outputs(self, output: torch.Tensor, mb: SequenceBatch, with_entropy: bool):
        """Per response token: (logprob, entropy) for a policy, value for a critic; ``[b, R]``."""
        pos, tgt = response_positions(mb)
        pos, tgt = pos.to(output.device), tgt.to(output.device)
        rows = torch.arange(len(mb), device=output.device).unsqueeze(1)
        if self.spec.value_head:
            values = output[..., 0] if output.dim() == 3 else output
            return values[rows, pos].float(), None
        selected = output[rows, pos]  # [b, R, V/tp]
        vocab = unwrap(self.chunks[-1]).vocab_size
        return logprobs_and_entropy(selected, tgt, vocab, with_entropy=with_entropy)

    def _gather_results(self, n: int, share: list[int], micro: list[list[int]], results: list[Any]) -> Optional[dict]:
        """Results of this rank's share in original order (output ranks only)."""
        if not self._is_output_rank():
            return None
        order = [share[i] for mb in micro for i in mb]
        return {"index": order, "results": results}

    # ------------------------------------------------------------------ forward-only
    @torch.no_grad()
    def compute_logprobs(self, batch: SequenceBatch, with_entropy: bool = False) -> Optional[dict]:
        """Log p(response tokens) (and entropy) under the current weights, for this rank's share."""
        return self._forward_only(batch, lambda out, mb: self._token_outputs(out, mb, with_entropy))

    @torch.no_grad()
    def compute_values(self, batch: SequenceBatch) -> Optional[dict]:
        return self._forward_only(batch, lambda out, mb: self._token_outputs(out, mb, False))

    @torch.no_grad()
    def compute_scores(self, batch: SequenceBatch) -> Optional[dict]:
        """Reward-model score of each whole sequence: the scalar head at its last token."""
        return self._forward_only(batch, lambda out, mb: (self._last_token_values(out, mb),))

    def _last_token_values(self, output: torch.Tensor, mb: SequenceBatch) -> torch.Tensor:
        values = output[..., 0] if output.dim() == 3 else output
        last = torch.tensor([len(s) - 1 for s in mb.sequences], device=values.device)
        return values[torch.arange(len(mb), device=values.device), last].float()

    def _forward_only(self, batch: SequenceBatch, fn: Callable) -> Optional[dict]:
        for chunk in self.chunks:
            chunk.eval()
        share = self._dp_share(len(batch))
        if not share:  # fewer samples than dp ranks: join the collectives, return nothing
            self._run_schedule([self._filler(batch, list(range(len(batch))))], lambda out, mb: (None, []),
                               forward_only=True)
            return None
        local = batch.select(share)
        micro = self._micro_batches(local)
        results = self._run_schedule([local.select(m) for m in micro],
                                     lambda out, mb: (None, [t.cpu() if t is not None else None for t in fn(out, mb)]),
                                     forward_only=True)
        return self._gather_results(len(batch), share, micro, results)

    # ------------------------------------------------------------------ training
    def train(self, batch: SequenceBatch, minibatches: list[list[int]], denominators: list[dict[str, float]],
              algo: dict[str, Any]) -> dict[str, float]:
        """One pass of optimizer steps, one per mini-batch (indices into ``batch``)."""
        from megatron.core import parallel_state as mpu

        for chunk in self.chunks:
            chunk.train()
        dp = mpu.get_data_parallel_world_size()
        totals: dict[str, float] = {}   # "*_sum" metrics: add up over micro-batches (global denominators)
        means: dict[str, list[float]] = {}
        for mb_index, denom in zip(minibatches, denominators):
            share = [mb_index[i] for i in self._dp_share(len(mb_index))]
            local = batch.select(share) if share else self._filler(batch, mb_index)
            micro = self._micro_batches(local)
            scale = len(micro) * dp
            loss_fn = self._critic_loss if self.spec.value_head else self._actor_loss

            def per_output(out, mb, _denom=denom, _scale=scale, _filler=not share):
                loss, metrics = loss_fn(out, mb, _denom, algo)
                if _filler:
                    return loss * 0.0, {}
                return loss * _scale, {k: v.detach().float().cpu() for k, v in metrics.items()}

            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run_schedule([local.select(m) for m in micro], per_output, forward_only=False)
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.steps += 1
            for metrics in outputs:
                for k, v in metrics.items():
                    if k.endswith("_sum"):
                        totals[k] = totals.get(k, 0.0) + float(v) / len(minibatches)
                    else:
                        means.setdefault(k, []).append(float(v))
            means.setdefault("grad_norm", []).append(float(grad_norm) if grad_norm is not None else 0.0)
            means.setdefault("update_skipped", []).append(float(not ok))
        out = dict(totals)
        out.update({k: sum(v) / len(v) for k, v in means.items()})
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        # The group adds "*_sum" metrics over data-parallel output ranks and averages the rest.
        return out if self._is_output_rank() else {}

    def train_reward_model(self, pairs: SequenceBatch, minibatches: list[list[int]]) -> dict[str, float]:
        """Bradley-Terry (Ouyang et al. 2022, InstructGPT eq. 1): ``-log sigmoid(r_chosen - r_rejected)``,
        averaged over the pairs of each mini-batch. ``pairs`` holds pair ``i`` as sequences
        ``2i`` (chosen) and ``2i + 1`` (rejected); mini-batches, data-parallel shares and
        micro-batches are cut along pairs so a pair is always scored in one forward."""
        from megatron.core import parallel_state as mpu

        for chunk in self.chunks:
            chunk.train()
        dp = mpu.get_data_parallel_world_size()
        totals: dict[str, float] = {}
        grad_norms = []
        for mb_pairs in minibatches:
            share = [mb_pairs[i] for i in self._dp_share(len(mb_pairs))]
            filler = not share  # fewer pairs than dp ranks: one real pair, loss times zero
            if filler:
                share = mb_pairs[:1]
            micro = split_fixed(len(share), max(1, self.role_cfg.micro_batch_size // 2))
            scale = len(micro) * dp
            num_pairs = float(len(mb_pairs))

            def per_output(out, mb, _n=num_pairs, _scale=scale, _filler=filler):
                scores = self._last_token_values(out, mb)
                margin = scores[0::2] - scores[1::2]
                loss = -torch.nn.functional.logsigmoid(margin).sum() / _n
                if _filler:
                    return loss * 0.0, {}
                metrics = {"loss_sum": loss.detach(), "accuracy_sum": (margin > 0).float().sum() / _n,
                           "margin_sum": margin.detach().sum() / _n}
                return loss * _scale, {k: v.detach().float().cpu() for k, v in metrics.items()}

            micro_batches = [pairs.select([j for p in (share[i] for i in m) for j in (2 * p, 2 * p + 1)])
                             for m in micro]
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run_schedule(micro_batches, per_output, forward_only=False)
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.steps += 1
            grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)
            for metrics in outputs:
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v) / len(minibatches)
        out = dict(totals, grad_norm=sum(grad_norms) / len(grad_norms), lr=self.optimizer.param_groups[0]["lr"])
        return out if self._is_output_rank() else {}

    def _actor_loss(self, output: torch.Tensor, mb: SequenceBatch, denom: dict[str, float], algo: dict[str, Any]):
        from megarl.algos import PolicyLossConfig, entropy_bonus, get_policy_loss, kl_loss

        need_entropy = algo["entropy_coef"] != 0.0
        logprobs, entropy = self._token_outputs(output, mb, with_entropy=True)
        t = mb.tensors
        mask = t["response_mask"].to(logprobs.device)
        agg = dict(num_tokens=denom["num_tokens"], num_seqs=denom["num_seqs"])
        pcfg = PolicyLossConfig(**algo["policy_loss_cfg"])
        rollout_lp = t.get("rollout_logprobs")
        pg_loss, metrics = get_policy_loss(algo["policy_loss"])(
            logprobs, t["old_logprobs"].to(logprobs.device), t["advantages"].to(logprobs.device), mask, pcfg,
            rollout_logprobs=rollout_lp.to(logprobs.device) if rollout_lp is not None else None, **agg)
        loss = pg_loss
        out = {f"actor/{k}": v for k, v in metrics.items()}
        out["actor/pg_loss_sum"] = pg_loss.detach()
        if algo["kl_loss_coef"] and "ref_logprobs" in t:
            kl = kl_loss(logprobs, t["ref_logprobs"].to(logprobs.device), mask, algo["kl_estimator"],
                         agg_mode=pcfg.agg_mode, **agg)
            loss = loss + algo["kl_loss_coef"] * kl
            out["actor/kl_loss_sum"] = kl.detach()
        ent = entropy_bonus(entropy, mask, pcfg.agg_mode, **agg)
        out["actor/entropy_sum"] = ent.detach()
        if need_entropy:
            loss = loss - algo["entropy_coef"] * ent
        out["actor/loss_sum"] = loss.detach()
        return loss, out

    def _critic_loss(self, output: torch.Tensor, mb: SequenceBatch, denom: dict[str, float], algo: dict[str, Any]):
        from megarl.algos import value_loss

        values, _ = self._token_outputs(output, mb, with_entropy=False)
        t = mb.tensors
        mask = t["response_mask"].to(values.device)
        loss, metrics = value_loss(values, t["old_values"].to(values.device), t["returns"].to(values.device), mask,
                                   clip_range=algo["value_clip"], agg_mode=algo["agg_mode"],
                                   num_tokens=denom["num_tokens"], num_seqs=denom["num_seqs"])
        out = {f"critic/{k}": v for k, v in metrics.items()}
        out["critic/vf_loss_sum"] = loss.detach()
        return loss, out

    # ------------------------------------------------------------------ weights out
    def iter_hf_weights(self):
        from megarl.models import iter_hf_weights

        yield from iter_hf_weights(self.chunks)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Full HF-named tensors this rank yields (tests, export of small models)."""
        return {name: t.cpu().clone() for name, t in self.iter_hf_weights()}

    def call(self, fn: Callable, *args, **kwargs):
        """Run ``fn(worker, *args)`` on this rank (weight sync and other plug-ins)."""
        return fn(self, *args, **kwargs)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        from megarl.workers.train_state import save_train_state

        save_train_state(self, path)

    def load_checkpoint(self, path: str) -> None:
        from megarl.workers.train_state import load_train_state

        load_train_state(self, path)

    def shutdown(self) -> None:
        from megarl.parallel import destroy_distributed, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed()
