"""One Megatron rank of a role (actor, critic, reference, reward model).

The same class runs as a Ray actor (one per GPU/CPU rank) or in-process (backend ``local``).
Every public method is called on *all* ranks of the role at once by a ``WorkerGroup``; each rank
receives only its data-parallel group's :class:`~megarl.workers.dispatch.Shard` (the samples, their
micro-batch sizes and the global loss denominators, planned on the driver), runs megatron's
pipeline schedule over packed (THD) or padded micro-batches, and ranks on the last pipeline stage
with tp_rank 0 return flat result tensors in shard order, which the group puts back in batch order.

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

import datetime
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megarl.models.builder import built_layers, unwrap
from megarl.parallel.dist import hosts_rendezvous_store
from megarl.algos import LossSettings, PolicyLossConfig, entropy_bonus, get_policy_loss, kl_loss, value_loss
from megarl.data.batch import TokenBatch
from megarl.sync.rank import PushTarget, RankSender
from megarl.workers.batch import MicroInputs, common_shape, micro_inputs
from megarl.workers.dispatch import Shard
from megarl.workers.hf_export import write_hf_shard
from megarl.workers.offload import StateOffloader
from megarl.workers.routing import collect_routing_stats, routing_flags, set_batch_routes, trainer_fp32_lm_head
from megarl.workers.vocab_parallel import logprobs_and_entropy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _all_params_in(chunks: list[torch.nn.Module], dtype: torch.dtype) -> None:
    """Every parameter in the model dtype (megatron's Float16Module convention; the norm weights are
    built fp32 otherwise). Needed by megatron's CPU optimizer: the distributed optimizer hands it
    fp32 parameters as views, which a torch optimizer refuses ("can't optimize a non-leaf
    Tensor"); bf16 parameters get fp32 main copies, so the update stays fp32 either way, and
    served bf16 checkpoints hold bf16 norm weights too."""
    for chunk in chunks:
        for p in chunk.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)


def _metrics_to_host(outputs: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """A mini-batch's per-micro-batch metrics as floats, read in one device-to-host copy after the
    optimizer step (a copy per metric inside the loss would stall the GPU queue once per metric)."""
    keys = [(i, k) for i, metrics in enumerate(outputs) for k in metrics]
    out: list[dict[str, float]] = [{} for _ in outputs]
    if keys:
        values = torch.stack([outputs[i][k].reshape(()).float() for i, k in keys]).cpu().tolist()
        for (i, k), v in zip(keys, values):
            out[i][k] = v
    return out


@dataclass
class WorkerSpec:
    """Everything a rank needs to start, picklable for Ray."""

    role: str                  # actor | critic | ref | reward_model | teacher
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
        self.sender = RankSender()     # this rank's weight pushes (actor): pusher / IPC fan-in between pushes
        self.offloader: Optional[StateOffloader] = None   # colocated: state moved to host between phases

    # ------------------------------------------------------------------ set-up
    def _rendezvous_store(self) -> torch.distributed.Store:
        """Rank 0 of a Ray group holds the TCP store it opened in ``open_rendezvous`` (group.py);
        the other ranks dial it (a store on every rank: the same keys, no env:// prefix on some);
        a one-rank role needs none across processes (an in-process store, no port to bind)."""
        spec = self.spec
        store = getattr(self, "store", None)
        if store is not None:
            return store
        if spec.world_size == 1:
            return torch.distributed.HashStore()
        # rank 0 hosts it here when nobody opened it beforehand (ranks started with MASTER_PORT and
        # no launcher holding the store)
        return torch.distributed.TCPStore(spec.master_addr, spec.master_port, spec.world_size,
                                          is_master=hosts_rendezvous_store(spec.rank), wait_for_workers=False,
                                          timeout=datetime.timedelta(seconds=self.cfg.cluster.collective_timeout_s))

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
        if not torch.distributed.is_initialized():
            # every group of this rank (megatron's too: init_model_parallel) gets the run's timeout
            init_distributed(store=self._rendezvous_store(), timeout_s=self.cfg.cluster.collective_timeout_s)
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
                                  vpp=p.vpp if p.vpp > 1 else None, fp32_lm_head=trainer_fp32_lm_head(self.cfg),
                                  first_stage_layers=p.first_stage_layers, last_stage_layers=p.last_stage_layers)
        if self.cfg.cluster.device == "cuda":
            self.chunks = [c.cuda() for c in self.chunks]
        for chunk in self.chunks:
            chunk.config.variable_seq_lengths = True  # every micro-batch has its own length (packed or padded)
        if self.cfg.model.megatron_checkpoint and self.spec.role in ("actor", "ref"):
            from megarl.checkpoint import load_megatron

            load_megatron(self.chunks, self.cfg.model.megatron_checkpoint)
        else:
            load_hf_weights(self.chunks, str(path))
        from megarl.workers.lora import attach_adapters

        trainable = attach_adapters(self)   # LoRA: base frozen before DDP wraps the chunks
        if self.spec.trainable:
            self._setup_optimizer()
        else:   # frozen (reference, reward model): no gradients, so no gradient or optimizer memory
            for chunk in self.chunks:
                chunk.eval()
                chunk.requires_grad_(False)
        self.offloader = StateOffloader(self.chunks, self.optimizer, self._device())
        return {"rank": spec.rank, "role": spec.role, "params": sum(x.numel() for c in self.chunks for x in c.parameters()),
                "trainable": trainable or sum(x.numel() for c in self.chunks for x in c.parameters() if x.requires_grad),
                "pp_rank": mpu.get_pipeline_model_parallel_rank(), "num_layers": unwrap(self.chunks[0]).config.num_layers,
                "layers": built_layers(self.chunks)}

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

        from megarl.parallel.optimizer_kernels import install_optimizer_kernels
        from megarl.parallel.wgrad_accumulation import install_wgrad_accumulation

        o = self.role_cfg.optim
        # The distributed optimizer shards states over data-parallel ranks (on CPU too, through the
        # CPU shim). With one data-parallel rank there is nothing to shard and the plain optimizer
        # is used (its checkpoint path failed on one GPU: "Param id ... does not match any model
        # sharded param"), except under the CPU optimizer, which megatron builds inside it.
        from megatron.core import parallel_state as mpu

        cpu_optimizer = o.cpu_offload_fraction > 0
        use_dist_opt = cpu_optimizer or (o.distributed_optimizer and mpu.get_data_parallel_world_size() > 1)
        if cpu_optimizer:
            _all_params_in(self.chunks, DTYPES[self.cfg.model.dtype])
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=use_dist_opt)
        self.chunks = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in self.chunks]
        # weight gradients straight into DDP's main_grad (megatron's gradient_accumulation_fusion
        # without Apex): one GEMM per linear layer instead of a GEMM, a temporary and an add
        install_wgrad_accumulation(self.chunks)
        config = self.chunks[0].config
        config.finalize_model_grads_func = finalize_model_grads
        config.no_sync_func = [c.no_sync for c in self.chunks] if len(self.chunks) > 1 else self.chunks[0].no_sync
        bf16 = self.cfg.model.dtype == "bfloat16"
        opt_cfg = OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                                  adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                                  clip_grad=o.clip_grad, use_distributed_optimizer=use_dist_opt,
                                  bf16=bf16, params_dtype=DTYPES[self.cfg.model.dtype],
                                  # megatron-core's own CPU optimizer (HybridDeviceOptimizer), as verl uses it
                                  optimizer_cpu_offload=cpu_optimizer,
                                  optimizer_offload_fraction=o.cpu_offload_fraction,
                                  overlap_cpu_optimizer_d2h_h2d=cpu_optimizer)
        # megatron's no-Apex/no-TE norm and copies loop per tensor (a host sync per tensor for the norm)
        install_optimizer_kernels()
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

    # ------------------------------------------------------------------ micro-batches
    def _packed(self) -> bool:
        return bool(getattr(self.role_cfg, "packing", False))

    def _inputs(self, micro: list[TokenBatch], device: torch.device) -> list[MicroInputs]:
        """Model inputs of each micro-batch (packed row or padded block) on ``device``. megatron's
        interleaved (virtual pipeline) schedule exchanges activations of one fixed shape, so there
        every micro-batch is padded to a common one (packed: one padding sequence at the end)."""
        from megatron.core import parallel_state as mpu

        config = unwrap(self.chunks[0]).config
        multiple = config.tensor_model_parallel_size if config.sequence_parallel else 1
        cp, cp_rank = mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank()
        length, rows = common_shape(micro, self._packed(), cp) if len(self.chunks) > 1 else (0, 0)
        return [micro_inputs(mb, self._packed(), multiple, length, rows, cp, cp_rank).to(device) for mb in micro]

    def _device(self) -> torch.device:
        return torch.device("cuda") if self.cfg.cluster.device == "cuda" else torch.device("cpu")

    # ------------------------------------------------------------------ schedule
    def _run_schedule(self, micro: list[MicroInputs], per_output: Callable, forward_only: bool) -> list[Any]:
        """Run megatron's forward(-backward) schedule; ``per_output(output, mi) -> (loss, data)``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = self._device()
        routing = routing_flags(self.spec.role, self.cfg, forward_only)

        def step(data_iter, model):
            mi = next(data_iter)
            set_batch_routes(model, mi, **routing)  # MoE: the rollout's experts (R3)
            output = model(mi.input_ids, mi.position_ids, None, packed_seq_params=mi.packed)

            def loss_func(output_tensor, non_loss_data=False):
                if mi.empty:  # placeholder micro-batch: connected to the graph, adds nothing
                    zero = output_tensor.sum() * 0.0
                    return zero if non_loss_data else (zero, {})
                loss, data = per_output(output_tensor, mi)
                if forward_only:
                    return data if non_loss_data else (torch.zeros((), device=device), data)
                return loss, data
            return output, loss_func

        chunks = self.chunks
        iters = [iter(micro) for _ in chunks] if len(chunks) > 1 else iter(micro)
        # megatron's schedule divides seq_length by the context-parallel size (the rank's share)
        seq_len = max(mi.input_ids.shape[1] * (mi.cp.cp if mi.cp is not None else 1) for mi in micro)
        rows = max(mi.input_ids.shape[0] for mi in micro)
        fb = get_forward_backward_func()
        out = fb(forward_step_func=step, data_iterator=iters, model=chunks if len(chunks) > 1 else chunks[0],
                 num_microbatches=len(micro), seq_length=seq_len, micro_batch_size=rows,
                 forward_only=forward_only, collect_non_loss_data=forward_only)
        # one entry per micro-batch on the last stage; placeholders carry no data
        return [d for d, mi in zip(out, micro) if not mi.empty] if len(out) == len(micro) else out

    def _token_outputs(self, output: torch.Tensor, mi: MicroInputs, with_entropy: bool):
        """Per response token ``[b, R]``: (logprob, entropy or None) for a policy, (value, None) for a
        critic. Computed on every output row (one fused pass, no gathered copy of the logits), then
        read at ``pred_index`` (context parallel: after gathering the rows of the CP group)."""
        pred = mi.pred_index
        if self.spec.value_head:
            values = output[..., 0] if output.dim() == 3 else output
            return mi.global_rows(values.reshape(-1))[pred].float(), None
        vocab = unwrap(self.chunks[-1]).vocab_size
        rows = output.reshape(-1, output.shape[-1])
        lp, ent = logprobs_and_entropy(rows, mi.next_ids, vocab, with_entropy=with_entropy)
        return mi.global_rows(lp)[pred], (mi.global_rows(ent)[pred] if ent is not None else None)

    # ------------------------------------------------------------------ forward-only
    @torch.no_grad()
    def compute_logprobs(self, shard: Any, with_entropy: bool = False) -> Optional[dict]:
        """Log p(response tokens) (and entropy) under the current weights for this data-parallel
        group's shard: ``{"token": {"logprobs": [sum R], "entropy": ...}}`` in shard order."""
        def fn(out, mi):
            lp, ent = self._token_outputs(out, mi, with_entropy)
            keep = mi.mask.bool()
            res = {"logprobs": lp[keep]}
            if ent is not None:
                res["entropy"] = ent[keep]
            return res
        return self._forward_only(shard, fn, "token")

    @torch.no_grad()
    def compute_ref_logprobs(self, shard: Any, with_entropy: bool = False) -> Optional[dict]:
        """LoRA actor: ``compute_logprobs`` of the base model (adapters off), the KL reference."""
        from megarl.workers.lora import reference_logprobs

        return reference_logprobs(self, shard, with_entropy)

    @torch.no_grad()
    def compute_values(self, shard: Any) -> Optional[dict]:
        def fn(out, mi):
            values, _ = self._token_outputs(out, mi, False)
            return {"values": values[mi.mask.bool()]}
        return self._forward_only(shard, fn, "token")

    @torch.no_grad()
    def compute_scores(self, shard: Any) -> Optional[dict]:
        """Reward-model score of each whole sequence: the scalar head at its last token."""
        return self._forward_only(shard, lambda out, mi: {"scores": self._last_token_values(out, mi)}, "sample")

    def _last_token_values(self, output: torch.Tensor, mi: MicroInputs) -> torch.Tensor:
        values = output[..., 0] if output.dim() == 3 else output
        return mi.global_rows(values.reshape(-1))[mi.last_index].float()

    def _forward_only(self, shard: Any, fn: Callable, per: str) -> Optional[dict]:
        for chunk in self.chunks:
            chunk.eval()
        shard = Shard.from_payload(shard)
        micro = [mb for minibatch in shard.minibatches() for mb in minibatch]
        results = self._run_schedule(self._inputs(micro, self._device()),
                                     lambda out, mi: (None, {k: v.cpu() for k, v in fn(out, mi).items()}),
                                     forward_only=True)
        if not self._is_output_rank():
            return None
        keys = results[0].keys() if results else ()
        out = {}
        for k in keys:  # execution order -> shard order; numpy: Ray returns it through shared memory
            out[k] = shard.to_batch_order(torch.cat([r[k] for r in results]), per).numpy()
        return {per: out}

    # ------------------------------------------------------------------ training
    def train_batch(self, shard: Any, loss: Optional[LossSettings] = None) -> dict[str, float]:
        """One pass of optimizer steps, one per mini-batch of the shard (with its global
        denominators), with this role's loss: the policy loss (actor), the value loss (critic) or
        the pairwise Bradley-Terry loss (reward model). Metrics named ``*_sum`` carry global
        denominators and add up over micro-batches; the rest are averaged."""
        from megatron.core import parallel_state as mpu

        for chunk in self.chunks:
            chunk.train()
        shard = Shard.from_payload(shard)
        dp = mpu.get_data_parallel_world_size()
        loss_fn = self._role_loss()
        totals: dict[str, float] = {}
        means: dict[str, list[float]] = {}
        minibatches = shard.minibatches()
        device = self._device()
        for micro, denom in zip(minibatches, shard.denominators):
            scale = len(micro) * dp

            def per_output(out, mi, _denom=denom, _scale=scale):
                value, metrics = loss_fn(out, mi, _denom, loss)
                return value * _scale, {k: v.detach().float() for k, v in metrics.items()}

            for chunk in self.chunks:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = self._run_schedule(self._inputs(micro, device), per_output, forward_only=False)
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.steps += 1
            for metrics in _metrics_to_host(outputs):
                for k, v in metrics.items():
                    if k.endswith("_sum"):
                        totals[k] = totals.get(k, 0.0) + v / len(minibatches)
                    else:
                        means.setdefault(k, []).append(v)
            means.setdefault("grad_norm", []).append(float(grad_norm) if grad_norm is not None else 0.0)
            means.setdefault("update_skipped", []).append(float(not ok))
        out = dict(totals)
        out.update({k: sum(v) / len(v) for k, v in means.items()})
        out["lr"] = self.optimizer.param_groups[0]["lr"]
        # The group adds "*_sum" metrics over data-parallel output ranks and averages the rest.
        return out if self._is_output_rank() else {}

    def _role_loss(self) -> Callable:
        if self.spec.role == "reward_model":
            return self._pairwise_loss
        return self._critic_loss if self.spec.value_head else self._actor_loss

    def _pairwise_loss(self, output: torch.Tensor, mi: MicroInputs, denom: dict[str, float], _: Any = None):
        """Bradley-Terry (Ouyang et al. 2022, InstructGPT eq. 1): ``-log sigmoid(r_chosen - r_rejected)``,
        averaged over the pairs of each mini-batch. The shard holds pair ``i`` as sequences ``2i``
        (chosen) and ``2i + 1`` (rejected); its micro-batches are cut along pairs so a pair is always
        scored in one forward; ``denom["num_pairs"]`` is the mini-batch's global pair count."""
        n = float(denom["num_pairs"])
        scores = self._last_token_values(output, mi)
        margin = scores[0::2] - scores[1::2]
        loss = -torch.nn.functional.logsigmoid(margin).sum() / n
        return loss, {"loss_sum": loss.detach(), "accuracy_sum": (margin > 0).float().sum() / n,
                      "margin_sum": margin.detach().sum() / n}

    def _actor_loss(self, output: torch.Tensor, mi: MicroInputs, denom: dict[str, float], settings: LossSettings):
        logprobs, entropy = self._token_outputs(output, mi, with_entropy=True)
        fields = mi.batch.token_fields
        dev = logprobs.device
        mask = mi.loss_mask.to(dev)   # model tokens only: environment tokens of agent trajectories are not trained on
        agg = dict(num_tokens=denom["num_tokens"], num_seqs=denom["num_seqs"])
        pcfg: PolicyLossConfig = settings.policy
        rollout_lp = mi.padded("rollout_logprobs").to(dev) if "rollout_logprobs" in fields else None
        pg_loss, metrics = get_policy_loss(settings.policy_loss)(
            logprobs, mi.padded("old_logprobs").to(dev), mi.padded("advantages").to(dev), mask, pcfg,
            rollout_logprobs=rollout_lp, **agg)
        loss = pg_loss
        out = {f"actor/{k}": v for k, v in metrics.items()}
        out["actor/pg_loss_sum"] = pg_loss.detach()
        if settings.kl_loss_coef and "ref_logprobs" in fields:
            kl = kl_loss(logprobs, mi.padded("ref_logprobs").to(dev), mask, settings.kl_estimator,
                         agg_mode=pcfg.agg_mode, **agg)
            loss = loss + settings.kl_loss_coef * kl
            out["actor/kl_loss_sum"] = kl.detach()
        ent = entropy_bonus(entropy, mask, pcfg.agg_mode, **agg)
        out["actor/entropy_sum"] = ent.detach()
        if settings.entropy_coef != 0.0:
            loss = loss - settings.entropy_coef * ent
        out["actor/loss_sum"] = loss.detach()
        return loss, out

    def _critic_loss(self, output: torch.Tensor, mi: MicroInputs, denom: dict[str, float], settings: LossSettings):
        values, _ = self._token_outputs(output, mi, with_entropy=False)
        dev = values.device
        loss, metrics = value_loss(values, mi.padded("old_values").to(dev), mi.padded("returns").to(dev),
                                   mi.loss_mask.to(dev), clip_range=settings.value_clip, agg_mode=settings.agg_mode,
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
        with self.offloader.resident_for(("params",)):
            return {name: t.cpu().clone() for name, t in self.iter_hf_weights()}

    def export_hf(self, out_dir: str) -> dict[str, str]:
        """Write the HF tensors this rank owns into its own safetensors file in ``out_dir``;
        returns {name: file} for the index (empty on ranks that own none)."""
        with self.offloader.resident_for(("params",)):
            return write_hf_shard(self.iter_hf_weights(), out_dir, self.spec.rank)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA actor: this rank's adapters in PEFT's names (owner ranks only; every rank must call)."""
        from megarl.workers.lora import adapter_tensors

        with self.offloader.resident_for(("params",)):   # e.g. a restarted server's push mid-rollout
            return adapter_tensors(self)

    def push_weights(self, target: PushTarget, version: str) -> dict[str, Any]:
        """Every actor rank: this rank's part of one weight push to all servers (the driver holds
        the weight-update session around it)."""
        with self.offloader.resident_for(("params",)):
            return self.sender.push(self.chunks, target, version)

    def push_to_server(self, target: PushTarget, version: str, server: int, tag: str) -> dict[str, Any]:
        """Every actor rank: the current weights to one (restarted) server alone."""
        with self.offloader.resident_for(("params",)):   # mid-rollout: the trainer's weights are on the host
            return self.sender.push_to_server(self.chunks, target, version, server, tag)

    def close_pusher(self) -> None:
        """Leave the weight-update groups (before shutdown, or when a server's URL changed)."""
        self.sender.close()

    def routing_stats(self) -> dict[int, list[float]]:
        """MoE: this rank's per-layer router agreement counters since the last call."""
        return collect_routing_stats(self.chunks)

    def arm_watchdog(self, folder: str) -> Any:
        """Dump this rank's stacks into ``folder`` on the watchdog's signal and say where the rank runs
        (pid, host, Ray node): asked at start-up, since a hung rank answers no call
        (``megarl/workers/stack_dump.py``, ``megarl/watchdog.py``)."""
        from megarl.workers.stack_dump import arm

        return arm(folder, self.spec.role, self.spec.rank)

    def probe(self, fn: Callable, *args, **kwargs):
        """Run ``fn(worker, *args)`` on this rank and return its result: a diagnostic hook for
        tests and debugging sessions (megarl itself calls only named methods)."""
        return fn(self, *args, **kwargs)

    # ------------------------------------------------------------------ memory between phases
    def offload(self, kinds: list[str]) -> dict[str, float]:
        """Move these kinds of state (params, grads, optimizer) to host memory; the device memory
        goes back to the driver for the colocated rollout server or another role."""
        return self.offloader.offload(kinds).metrics("offload")

    def onload(self, kinds: list[str]) -> dict[str, float]:
        """Bring them back (bit for bit; gradients zero-filled) before this role's next pass."""
        return self.offloader.onload(kinds).metrics("onload")

    def memory_stats(self, reset_peak: bool = True) -> dict[str, float]:
        """This rank's device memory: allocated now, peak since the last call, host bytes held for
        offloaded state."""
        out = {"host_offload_bytes": float(self.offloader.host_bytes() if self.offloader else 0)}
        if self.cfg.cluster.device == "cuda":
            out.update(allocated=float(torch.cuda.memory_allocated()), peak=float(torch.cuda.max_memory_allocated()),
                       reserved=float(torch.cuda.memory_reserved()))
            if reset_peak:
                torch.cuda.reset_peak_memory_stats()
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str) -> None:
        from megarl.workers.train_state import save_train_state

        with self.offloader.resident_for(("params", "optimizer")):
            save_train_state(self, path)

    def load_checkpoint(self, path: str) -> None:
        from megarl.workers.train_state import load_train_state

        with self.offloader.resident_for(("params", "optimizer")):
            load_train_state(self, path)

    def shutdown(self) -> None:
        from megarl.parallel import destroy_distributed, destroy_model_parallel

        if self.offloader is not None:
            self.offloader.close()
        destroy_model_parallel()
        destroy_distributed()
