"""Validation of a whole run before any process starts.

Each rule appends one line naming the dotted field it blames, so a 64-node launch fails in the
first second on the login node instead of after Ray, NCCL and a checkpoint load. The parallel
arithmetic mirrors what megatron-core asserts deep inside ``initialize_model_parallel`` and
``TransformerConfig``, said in the recipe's own terms.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

from megarl.config.loader import ConfigError
from megarl.config.schema import LoRAConfig, ModelArch, ParallelConfig, RoleConfig, RolloutConfig, RunConfig

GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"}
ROLES = ("actor", "critic", "ref", "reward_model")
PROFILED_PHASES = ("rollout", "release", "old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "train",
                   "sync")  # Trainer.step's timers

# HF config.json key(s) -> ModelArch field; the first key present wins.
HF_ARCH_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "ffn_hidden_size": ("intermediate_size",),
    "num_attention_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_experts", "n_routed_experts", "num_local_experts"),  # transformers 5: num_local_experts
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_top_k": ("num_experts_per_tok",),
    "num_shared_experts": ("n_shared_experts",),
    "first_k_dense": ("first_k_dense_replace",),
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
    "tie_word_embeddings": ("tie_word_embeddings",),
}


def dp_size(role: RoleConfig) -> int:
    """Data-parallel size derived from the role's pool and layout (0 if it does not divide)."""
    p = role.parallel
    model_parallel = p.tp * p.pp * p.cp
    return role.gpus // model_parallel if model_parallel and role.gpus % model_parallel == 0 else 0


def max_sequence_len(cfg: RunConfig) -> int:
    """The longest sample a run can produce: prompt + response, where an agent's response is its
    whole trajectory (``agent.max_response_tokens``: model turns and observations). Rollout
    servers' context length and the trainer's micro-batch budgets are sized from it."""
    r = cfg.rollout
    response = r.sampling.max_new_tokens
    if cfg.agent.enabled:
        response = max(response, cfg.agent.max_response_tokens)
    return r.max_prompt_len + response


def hf_config_path(hf_path: str) -> Path | None:
    if hf_path.startswith("builtin:"):
        return None
    path = Path(hf_path).expanduser() / "config.json"
    return path if path.is_file() else None


def arch_from_hf(config: dict[str, Any]) -> dict[str, Any]:
    """ModelArch fields read from an HF config.json dict (only keys that are present)."""
    found: dict[str, Any] = {}
    for field_name, keys in HF_ARCH_KEYS.items():
        for key in keys:
            if config.get(key) is not None:
                found[field_name] = config[key]
                break
    return found


def resolve_arch(cfg: RunConfig, problems: list[str]) -> None:
    """Fill ``model.arch`` from config.json where readable; a recipe value that disagrees is an error."""
    found = fill_arch(cfg.model.arch, cfg.model.hf_path, "model.arch", "model.hf_path", problems)
    if found is not None:
        path, hf = found
        problems.extend(f"model.hf_path: {path}: {line}" for line in hf_mapping_refusals(hf))


def fill_arch(arch: ModelArch, hf_path: str, arch_field: str, path_field: str,
              problems: list[str]) -> tuple[Path, dict[str, Any]] | None:
    """Fill ``arch`` from ``hf_path``'s config.json where readable (a recipe value that disagrees is
    a problem on ``arch_field``); returns (its path, its contents), or None."""
    path = hf_config_path(hf_path)
    if path is None:
        return None
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        problems.append(f"{path_field}: cannot read {path}: {err}")
        return None
    for name, value in arch_from_hf(hf).items():
        current = getattr(arch, name)
        if current not in (0, False) and current != value:
            problems.append(f"{arch_field}.{name}: recipe says {current} but {path} says {value}")
        setattr(arch, name, value)
    return path, hf


def hf_mapping_refusals(hf: dict[str, Any]) -> list[str]:
    """Fields of this config.json that megarl would not compute exactly (``models/hf_audit.py``)."""
    from megarl.models.config import load_hf_config
    from megarl.models.hf_audit import refusals

    try:
        return refusals(load_hf_config(dict(hf)))
    except (ValueError, KeyError, TypeError) as err:  # transformers refuses the config itself
        return [f"transformers cannot read it: {err}"]


def _check_layer_split(name: str, p: ParallelConfig, num_layers: int, problems: list[str]) -> None:
    """The split megatron-core builds (``TransformerConfig.__post_init__`` and
    ``transformer_block.get_num_layers_to_build``): the first / last pipeline rank hold
    ``first_stage_layers`` / ``last_stage_layers`` when set, each a multiple of vpp; the rest split
    evenly over the middle ranks, each rank's share a multiple of vpp."""
    where = f"{name}.parallel"
    uneven = [(k, getattr(p, k)) for k in ("first_stage_layers", "last_stage_layers") if getattr(p, k)]
    for key, value in uneven:
        if value < 0:
            problems.append(f"{where}.{key}: must be >= 0 (0 = even split), got {value}")
            return
    if uneven and p.pp < 2:
        problems.append(f"{where}.{uneven[0][0]}: uneven pipeline stages need pp >= 2")
        return
    vpp = p.vpp if p.pp > 1 else 1
    for key, value in uneven:
        if value % vpp:
            problems.append(f"{where}.{key}: {value} layers do not split into vpp = {vpp} virtual chunks")
            return
    rest = num_layers - sum(v for _, v in uneven)
    stages = p.pp - len(uneven)
    if len(uneven) == 2 and vpp > 1 and not stages:
        # megatron-core 0.16 computes the interleaved offsets per middle stage and divides by zero
        problems.append(f"{where}.vpp: uneven first and last stages with virtual chunks need a middle stage "
                        f"(pp >= 3), got pp = {p.pp}")
        return
    if rest < 0 or bool(stages) != bool(rest) or (stages and rest % (stages * vpp)):
        what = f"num_layers = {num_layers}" + "".join(f" - {k} {v}" for k, v in uneven)
        what += f" = {rest} layers do" if uneven else " does"
        problems.append(f"{where}.pp: {what} not split evenly over {stages} stage(s) * vpp {vpp}")


def _check_parallel(name: str, role: RoleConfig, arch: ModelArch, device: str, trained: bool,
                    problems: list[str]) -> None:
    p: ParallelConfig = role.parallel
    for key in ("tp", "pp", "vpp", "ep", "etp", "cp"):
        if getattr(p, key) < 1:
            problems.append(f"{name}.parallel.{key}: must be >= 1, got {getattr(p, key)}")
    if role.gpus < 1:
        problems.append(f"{name}.gpus: must be >= 1 for an enabled role, got {role.gpus}")
        return
    if any(getattr(p, k) < 1 for k in ("tp", "pp", "vpp", "ep", "etp", "cp")):
        return
    mp = p.tp * p.pp * p.cp
    if role.gpus % mp:
        problems.append(f"{name}.gpus: {role.gpus} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {mp}")
        return
    if arch.num_attention_heads and arch.num_attention_heads % p.tp:
        problems.append(f"{name}.parallel.tp: {p.tp} does not divide num_attention_heads = {arch.num_attention_heads}")
    kv = arch.num_kv_heads if not arch.kv_lora_rank else arch.num_attention_heads
    if kv and kv % p.tp:
        problems.append(f"{name}.parallel.tp: {p.tp} does not divide num_kv_heads = {kv} (megatron shards KV groups over TP)")
    if arch.num_layers:
        _check_layer_split(name, p, arch.num_layers, problems)
    if p.vpp > 1 and p.pp < 2:
        problems.append(f"{name}.parallel.vpp: virtual pipeline ({p.vpp}) needs pp >= 2")
    elif p.vpp > 1 and trained and device == "cpu":
        # megatron's interleaved schedule sends activations and gradients to one peer over untagged
        # p2p; gloo pairs them wrongly (wrong gradients, or a hang). Forward-only roles run it right.
        problems.append(f"{name}.parallel.vpp: virtual pipeline training needs cluster.device=cuda (NCCL); over gloo "
                        f"megatron's interleaved schedule gives wrong gradients or hangs -- use vpp=1 on CPU")
    if p.ep > 1 or p.etp > 1:
        if not arch.num_experts:
            problems.append(f"{name}.parallel.ep: ep = {p.ep}, etp = {p.etp} but the model has no experts")
        elif arch.num_experts % p.ep:
            problems.append(f"{name}.parallel.ep: {p.ep} does not divide num_experts = {arch.num_experts}")
        if (role.gpus // p.pp) % (p.ep * p.etp):
            problems.append(f"{name}.parallel.ep: ep*etp = {p.ep * p.etp} does not divide gpus/pp = {role.gpus // p.pp}")
    if p.sequence_parallel and p.tp < 2:
        problems.append(f"{name}.parallel.sequence_parallel: needs tp >= 2")
    if p.sequence_parallel and device == "cpu":
        problems.append(f"{name}.parallel.sequence_parallel: not supported on CPU (torch norms refuse it)")
    if p.cp > 1 and not role.packing:
        problems.append(f"{name}.packing: context parallel (cp = {p.cp}) splits packed (THD) micro-batches in "
                        f"megarl's attention; set packing: true")
    if p.cp > 1 and arch.kv_lora_rank:
        problems.append(f"{name}.parallel.cp: context parallel with multi-latent attention (MLA) is not implemented")
    if role.max_tokens_per_micro_batch < 0:
        problems.append(f"{name}.max_tokens_per_micro_batch: must be >= 0")
    if role.forward_max_tokens_per_micro_batch < 0:
        problems.append(f"{name}.forward_max_tokens_per_micro_batch: must be >= 0")
    if role.micro_batch_size < 1:
        problems.append(f"{name}.micro_batch_size: must be >= 1, got {role.micro_batch_size}")


def _check_offload(cfg: RunConfig, problems: list[str]) -> None:
    """Offload switches and megatron's CPU optimizer: where they can run."""
    for name in ROLES:
        role = getattr(cfg, name)
        if not role.enabled:
            continue
        f = role.optim.cpu_offload_fraction
        if not 0.0 <= f <= 1.0:
            problems.append(f"{name}.optim.cpu_offload_fraction: must be in [0, 1], got {f}")
        elif f > 0 and name in cfg.trained_roles:
            if cfg.cluster.device != "cuda":
                problems.append(f"{name}.optim.cpu_offload_fraction: megatron's CPU optimizer "
                                f"(HybridDeviceOptimizer) moves states between a GPU and the host; needs cluster.device=cuda")
            elif cfg.model.dtype != "bfloat16":
                problems.append(f"{name}.optim.cpu_offload_fraction: needs model.dtype=bfloat16 (megatron's CPU "
                                f"optimizer updates fp32 main copies of bf16 parameters), got {cfg.model.dtype}")
        if name not in cfg.trained_roles:
            for kind in ("grads", "optimizer"):
                if getattr(role.offload, kind):
                    problems.append(f"{name}.offload.{kind}: a frozen role holds no {kind}; only offload.params applies")


def _check_cp_budget(cfg: RunConfig, problems: list[str]) -> None:
    """Under context parallelism a packed micro-batch holds ``max_tokens_per_micro_batch x cp``
    tokens (each CP rank ``1 / cp`` of them), every sequence padded to a multiple of ``2 cp``: the
    longest sample must fit one, or training would fail after the rollout was paid for."""
    for name in ROLES:
        if getattr(cfg, name).enabled:
            _check_role_cp_budget(cfg, name, problems)


def _check_role_cp_budget(cfg: RunConfig, name: str, problems: list[str]) -> None:
    """:func:`_check_cp_budget` for one role."""
    longest = max_sequence_len(cfg)
    role = getattr(cfg, name)
    p = role.parallel
    if p.cp <= 1 or not role.packing:
        return
    padded = -(-longest // (2 * p.cp)) * 2 * p.cp
    for field_name in ("max_tokens_per_micro_batch", "forward_max_tokens_per_micro_batch"):
        per_rank = getattr(role, field_name)
        if per_rank and padded > per_rank * p.cp:
            problems.append(f"{name}.{field_name}: {per_rank} x cp {p.cp} = {per_rank * p.cp} tokens is less "
                            f"than the longest sample (max_prompt_len + max_new_tokens = {longest}, {padded} "
                            f"padded to a multiple of 2*cp)")


def _check_batches(cfg: RunConfig, problems: list[str]) -> None:
    b, r = cfg.batch, cfg.rollout
    if b.prompts_per_step < 1:
        problems.append(f"batch.prompts_per_step: must be >= 1, got {b.prompts_per_step}")
    if b.global_batch_size < 1:
        problems.append(f"batch.global_batch_size: must be >= 1, got {b.global_batch_size}")
        return
    samples = b.prompts_per_step * r.n_per_prompt
    if samples > 0 and samples % b.global_batch_size:
        problems.append(f"batch.global_batch_size: {b.global_batch_size} does not divide samples per step "
                        f"= prompts_per_step*n_per_prompt = {b.prompts_per_step}*{r.n_per_prompt} = {samples}")
    for name in cfg.trained_roles:
        role = getattr(cfg, name)
        dp = dp_size(role)
        if not dp:
            continue
        fixed_size = not role.packing and role.max_tokens_per_micro_batch == 0  # padded, micro_batch_size each
        if fixed_size and b.global_batch_size % (role.micro_batch_size * dp):
            problems.append(f"batch.global_batch_size: {b.global_batch_size} is not divisible by {name}.micro_batch_size*dp "
                            f"= {role.micro_batch_size}*{dp} = {role.micro_batch_size * dp}")
        elif b.global_batch_size % dp:
            problems.append(f"batch.global_batch_size: {b.global_batch_size} is not divisible by {name} dp = {dp}")


def _check_pools(cfg: RunConfig, problems: list[str]) -> None:
    c = cfg.cluster
    if c.nodes < 1:
        problems.append(f"cluster.nodes: must be >= 1, got {c.nodes}")
    if c.device == "cuda" and c.gpus_per_node < 1:
        problems.append("cluster.gpus_per_node: device is cuda but gpus_per_node is 0")
    if c.device == "cpu" and c.gpus_per_node:
        problems.append(f"cluster.device: cpu but gpus_per_node = {c.gpus_per_node}; set cluster.device=cuda")
    if c.backend == "local" and c.nodes > 1:
        problems.append("cluster.backend: local runs on one node; use ray for nodes > 1")
    if c.backend == "local":
        # backend 'local' runs each Megatron role as one rank in the trainer's process
        for n in cfg.megatron_roles:
            if getattr(cfg, n).gpus > 1:
                problems.append(f"cluster.backend: local runs one rank per role, {n}.gpus = {getattr(cfg, n).gpus}; "
                                f"use cluster.backend=ray (or {n}.gpus=1)")
                break
    roles = [n for n in ROLES if getattr(cfg, n).enabled]
    total = c.nodes * c.gpus_per_node
    if cfg.placement.mode == "colocated":
        for n in roles:
            if getattr(cfg, n).gpus != cfg.actor.gpus:
                problems.append(f"{n}.gpus: colocated pools must be equal; actor.gpus = {cfg.actor.gpus}, {n}.gpus = {getattr(cfg, n).gpus}")
        if c.device == "cuda" and cfg.rollout.gpus != cfg.actor.gpus:
            problems.append(f"rollout.gpus: colocated pools must be equal; actor.gpus = {cfg.actor.gpus}, rollout.gpus = {cfg.rollout.gpus}")
        if total and cfg.actor.gpus > total:
            problems.append(f"actor.gpus: {cfg.actor.gpus} GPUs asked, the cluster has nodes*gpus_per_node = {total}")
    elif c.device == "cuda":
        # Disaggregated: the reference and reward model may share the actor's pool (they run in
        # different phases), the critic and rollout need their own GPUs.
        need = cfg.actor.gpus + cfg.rollout.gpus + (cfg.critic.gpus if cfg.critic.enabled else 0)
        if need > total and not one_shared_gpu(cfg):
            problems.append(f"rollout.gpus: disaggregated pools need actor + critic + rollout = {need} GPUs, "
                            f"the cluster has {total} (one GPU may be shared: cluster.backend=local, actor.gpus=1, "
                            f"rollout.gpus=1, no critic)")
    if cfg.rollout.server_tp:
        _check_server_tp(cfg, problems)
    elif cfg.rollout.gpus or (c.device == "cuda" and cfg.rollout.engine == "sglang"):
        if cfg.rollout.tp < 1:
            problems.append(f"rollout.tp: must be >= 1, got {cfg.rollout.tp}")
        elif cfg.rollout.gpus % cfg.rollout.tp:
            problems.append(f"rollout.gpus: {cfg.rollout.gpus} is not divisible by rollout.tp = {cfg.rollout.tp}")
        elif cfg.rollout.gpus and cfg.rollout.num_servers != cfg.rollout.gpus // cfg.rollout.tp:
            problems.append(f"rollout.num_servers: {cfg.rollout.num_servers} but rollout.gpus/rollout.tp = "
                            f"{cfg.rollout.gpus // cfg.rollout.tp}")
        arch = cfg.model.arch
        if arch.num_kv_heads and not arch.kv_lora_rank and cfg.rollout.tp > arch.num_kv_heads and cfg.rollout.tp % arch.num_kv_heads:
            problems.append(f"rollout.tp: {cfg.rollout.tp} cannot replicate num_kv_heads = {arch.num_kv_heads}")
    if cfg.rollout.engine == "sglang" and c.device != "cuda" and not (cfg.rollout.server_urls or cfg.rollout.server_command):
        problems.append("rollout.engine: sglang needs cluster.device=cuda (or rollout.server_urls of running servers, "
                        "or a rollout.server_command that runs it on CPU)")


def _check_server_tp(cfg: RunConfig, problems: list[str]) -> None:
    """rollout.server_tp: one TP size per server, each >= 1; they fill rollout.gpus exactly."""
    r = cfg.rollout
    sizes = list(r.server_tp)
    if any(not isinstance(t, int) or t < 1 for t in sizes):
        problems.append(f"rollout.server_tp: every entry must be an integer >= 1, got {sizes}")
        return
    servers, what = (len(r.server_urls), "rollout.server_urls") if r.server_urls else (r.num_servers, "rollout.num_servers")
    if len(sizes) != servers:
        problems.append(f"rollout.server_tp: {len(sizes)} entries for {servers} server(s) ({what}); give one TP size "
                        f"per server")
    elif r.gpus and not r.server_urls and sum(sizes) != r.gpus:
        problems.append(f"rollout.server_tp: the servers' TP sizes add up to {sum(sizes)} GPUs, rollout.gpus = {r.gpus}")
    arch = cfg.model.arch
    for t in sizes:
        if arch.num_kv_heads and not arch.kv_lora_rank and t > arch.num_kv_heads and t % arch.num_kv_heads:
            problems.append(f"rollout.server_tp: {t} cannot replicate num_kv_heads = {arch.num_kv_heads}")
            break


def server_tp_sizes(cfg: RunConfig) -> list[int]:
    """Each rollout server's TP size: rollout.server_tp, else rollout.tp for every server."""
    r = cfg.rollout
    count = len(r.server_urls) if r.server_urls else r.num_servers
    return [int(t) for t in r.server_tp] if r.server_tp else [int(r.tp)] * count


def _check_algorithm(cfg: RunConfig, problems: list[str]) -> None:
    a, r = cfg.algorithm, cfg.rollout
    if cfg.trainer.mode == "reward_model":
        if not cfg.reward_model.enabled:
            problems.append("reward_model.enabled: trainer.mode = 'reward_model' trains the reward_model role")
        if cfg.data.source == "reasoning_gym":
            problems.append("data.source: trainer.mode = 'reward_model' needs preference pairs (jsonl or parquet)")
        return
    if a.advantage in GROUP_ESTIMATORS and r.n_per_prompt < 2:
        problems.append(f"rollout.n_per_prompt: {r.n_per_prompt}; advantage {a.advantage!r} compares samples "
                        f"of a group and needs n_per_prompt >= 2")
    if a.advantage == "gae" and not cfg.critic.enabled:
        problems.append("critic.enabled: advantage 'gae' needs a critic (set critic.enabled=true)")
    if a.advantage != "gae" and cfg.critic.enabled:
        problems.append(f"critic.enabled: a critic is trained but advantage {a.advantage!r} does not use values")
    if a.kl.mode != "none" and not cfg.ref.enabled:
        problems.append(f"ref.enabled: algorithm.kl.mode = {a.kl.mode!r} needs the reference model (ref.enabled=true)")
    if a.advantage == "reinforce_plus_plus" and a.kl.mode == "loss":
        problems.append("algorithm.kl.mode: reinforce_plus_plus puts KL in the reward; use kl.mode=reward")
    if not 0 < a.clip_low < 1:
        problems.append(f"algorithm.clip_low: must be in (0, 1), got {a.clip_low}")
    if a.clip_high <= 0:
        problems.append(f"algorithm.clip_high: must be > 0, got {a.clip_high}")
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        problems.append(f"algorithm.dual_clip_c: must be > 1, got {a.dual_clip_c}")
    _check_rollout_correction(cfg, problems)
    if not 0 <= a.gamma <= 1:
        problems.append(f"algorithm.gamma: must be in [0, 1], got {a.gamma}")
    if not 0 <= a.lam <= 1:
        problems.append(f"algorithm.lam: must be in [0, 1], got {a.lam}")
    if a.kl.coef < 0:
        problems.append(f"algorithm.kl.coef: must be >= 0, got {a.kl.coef}")
    if a.routing_replay == "rollout":
        _check_routing_replay(cfg, problems)
    if a.ppo_epochs < 1:
        problems.append(f"algorithm.ppo_epochs: must be >= 1, got {a.ppo_epochs}")
    if a.dynamic_sampling.enabled and a.advantage not in GROUP_ESTIMATORS:
        problems.append(f"algorithm.dynamic_sampling.enabled: needs a group estimator, advantage is {a.advantage!r}")
    if a.overlong.enabled and not 0 < a.overlong.buffer_len < r.sampling.max_new_tokens:
        problems.append(f"algorithm.overlong.buffer_len: must be in (0, max_new_tokens = {r.sampling.max_new_tokens}), "
                        f"got {a.overlong.buffer_len}")
    s = r.sampling
    if s.temperature < 0:
        problems.append(f"rollout.sampling.temperature: must be >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        problems.append(f"rollout.sampling.top_p: must be in (0, 1], got {s.top_p}")
    if s.top_k == 0 or s.top_k < -1:
        problems.append(f"rollout.sampling.top_k: must be -1 (off) or >= 1, got {s.top_k}")
    if s.max_new_tokens < 1:
        problems.append(f"rollout.sampling.max_new_tokens: must be >= 1, got {s.max_new_tokens}")
    if r.n_per_prompt < 1:
        problems.append(f"rollout.n_per_prompt: must be >= 1, got {r.n_per_prompt}")


def _check_rollout_correction(cfg: RunConfig, problems: list[str]) -> None:
    """``algorithm.rollout_correction`` (and the legacy ``tis_cap`` it replaces): bounds that make a
    band, one way of saying it, and something to correct."""
    from megarl.config.served import correction_configured

    a = cfg.algorithm
    rc, name = a.rollout_correction, "algorithm.rollout_correction"
    asked = rc.enabled or correction_configured(rc)
    if a.tis_cap is not None and a.tis_cap < 0:
        problems.append(f"algorithm.tis_cap: must be > 0 (0 = off), got {a.tis_cap}")
    if a.tis_cap is not None and (rc.enabled is not None or asked):
        problems.append(f"algorithm.tis_cap: set {name} or the legacy tis_cap, not both")
    if a.tis_cap and a.old_logprobs == "rollout":
        problems.append(f"algorithm.tis_cap: {a.tis_cap} corrects rollout-vs-trainer logprobs, but "
                        f"algorithm.old_logprobs = 'rollout' makes them the same (set tis_cap: 0 or null)")
    if asked and a.old_logprobs == "rollout":
        problems.append(f"{name}.enabled: it corrects rollout-vs-trainer logprobs, but algorithm.old_logprobs = "
                        f"'rollout' makes them the same (set enabled: false)")
    if rc.upper is not None and rc.upper <= 0:
        problems.append(f"{name}.upper: must be > 0 (or null: unbounded), got {rc.upper}")
    if rc.lower is not None and rc.lower < 0:
        problems.append(f"{name}.lower: must be >= 0 (or null: unbounded), got {rc.lower}")
    if rc.lower is None and rc.upper is None:
        problems.append(f"{name}.upper: lower and upper are both null; set at least one bound")
    if rc.lower is not None and rc.upper is not None and rc.lower >= rc.upper:
        problems.append(f"{name}.lower: {rc.lower} must be < upper = {rc.upper}")
    if not rc.reweight and rc.mode != "mask":
        problems.append(f"{name}.reweight: false (weight 1 inside the bounds) needs mode 'mask', got {rc.mode!r}")


def _check_routing_replay(cfg: RunConfig, problems: list[str]) -> None:
    """R3 needs an MoE model, routed experts from the rollout, and a router whose token order the
    replay knows (context parallel: routes sliced like the tokens; no full recompute under pipeline parallel, where megatron
    re-runs a micro-batch's forward after later micro-batches set their own routes)."""
    arch, p = cfg.model.arch, cfg.actor.parallel
    if hf_config_path(cfg.model.hf_path) is not None and not arch.num_experts:
        problems.append("algorithm.routing_replay: 'rollout' replays MoE routing but the model has no experts")
    if cfg.rollout.return_routed_experts is False:
        problems.append("rollout.return_routed_experts: false, but algorithm.routing_replay: rollout needs the "
                        "rollout's routed experts")
    if cfg.model.recompute == "full" and p.pp > 1:
        problems.append("model.recompute: full recompute with pp > 1 re-runs forwards out of order; routing replay "
                        "needs recompute none or selective there")
def one_shared_gpu(cfg: RunConfig) -> bool:
    """Disaggregated on one GPU: the trainer (backend ``local``, one rank, no critic) and one
    rollout server share the device as two processes, each keeping its memory (no release/resume:
    that is colocated's memory saver). Overlap then needs no second GPU, only idle time on the
    first (the trainer idles while the rollout generates and back)."""
    c = cfg.cluster
    return (c.backend == "local" and c.nodes == 1 and c.gpus_per_node == 1 and cfg.actor.gpus == 1
            and cfg.rollout.gpus <= 1 and not cfg.critic.enabled and not cfg.rollout.server_urls)


def push_transport(cfg: RunConfig) -> str:
    """``sync.transport`` -> the pusher's transport (distributed | tensor | disk). ``auto``: CUDA IPC
    when the trainer and its servers share a GPU (colocated, or one GPU shared disaggregated: NCCL
    refuses two ranks on one GPU), a broadcast group otherwise. Here, beside the checks that read
    it, so validation and the push (``sync/rank.py``) cannot disagree."""
    same_gpu = cfg.placement.mode == "colocated" or one_shared_gpu(cfg)
    return {"nccl": "distributed", "gloo": "distributed", "ipc": "tensor", "disk": "disk",
            "auto": "tensor" if cfg.cluster.device == "cuda" and same_gpu else "distributed"}[cfg.sync.transport]


def node_gather_misfit(tp: int, ep: int, etp: int, gpus_per_node: int) -> str:
    """Why the one-gather-per-node colocated push cannot run on this layout ('' when it can):
    megatron-core numbers TP ranks and expert-parallel ranks (behind expert TP) contiguously, so
    each group lies inside a node when its span divides the node's GPUs."""
    for name, span in (("actor.parallel.tp", tp), ("actor.parallel.ep x etp", ep * etp)):
        if span > gpus_per_node or gpus_per_node % span:
            return f"{name} = {span} does not divide cluster.gpus_per_node = {gpus_per_node} (its group would span nodes)"
    return ""


def colocated_gather(cfg: RunConfig) -> str:
    """``sync.colocated_gather`` -> the colocated IPC push's gather: ``node`` | ``everywhere`` (and
    ``none`` for pushes that are not colocated IPC). Read by validation, the plan and the push."""
    if push_transport(cfg) != "tensor" or cfg.placement.mode != "colocated":
        return "none"
    p, gpn = cfg.actor.parallel, max(cfg.cluster.gpus_per_node, 1)
    if cfg.sync.colocated_gather == "auto":
        spans = cfg.cluster.nodes > 1 and cfg.actor.gpus > gpn
        return "node" if spans and not node_gather_misfit(p.tp, p.ep, p.etp, gpn) else "everywhere"
    return cfg.sync.colocated_gather


def _check_rollout_mode(cfg: RunConfig, problems: list[str]) -> None:
    """Off-policy rollouts overlap generation with training: they need rollout servers that keep
    their device while the trainer trains (disaggregated; on one GPU both may share it)."""
    r = cfg.rollout
    if r.mode == "sync" or cfg.trainer.mode != "rl":
        return
    if cfg.placement.mode == "colocated":
        problems.append(f"rollout.mode: {r.mode} overlaps generation with training, but colocated rollout servers give "
                        f"their GPUs to the trainer while it trains; set placement.mode=disaggregated or keep "
                        f"rollout.mode=sync")
    if r.mode == "one_step_off" and r.max_staleness != 1:
        problems.append(f"rollout.max_staleness: one_step_off trains every batch one version behind (1), got "
                        f"{r.max_staleness}; use rollout.mode=async for another bound")
    if r.max_staleness < 0:
        problems.append(f"rollout.max_staleness: must be >= 0, got {r.max_staleness}")
    if not 0 < r.stale_weight <= 1:
        problems.append(f"rollout.stale_weight: must be in (0, 1], got {r.stale_weight}")
    if cfg.reward.kind == "model":
        problems.append(f"reward.kind: model scores on the trainer's reward-model ranks, which rollout.mode={r.mode} "
                        f"would call from the producer while they train; use rollout.mode=sync")


def _check_rest(cfg: RunConfig, problems: list[str]) -> None:
    for field_name in ("mps_trainer_sm_percent", "mps_rollout_sm_percent"):
        share = getattr(cfg.cluster, field_name)
        if share is not None and not 1 <= share <= 100:
            problems.append(f"cluster.{field_name}: must be in [1, 100] (or null: no limit), got {share}")
    for name in cfg.trained_roles:
        o = getattr(cfg, name).optim
        if o.lr <= 0:
            problems.append(f"{name}.optim.lr: must be > 0, got {o.lr}")
        if o.min_lr < 0 or o.min_lr > o.lr:
            problems.append(f"{name}.optim.min_lr: must be in [0, lr = {o.lr}], got {o.min_lr}")
        for beta in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(o, beta) < 1:
                problems.append(f"{name}.optim.{beta}: must be in [0, 1), got {getattr(o, beta)}")
    d, rw = cfg.data, cfg.reward
    if d.source in ("jsonl", "parquet") and not d.path:
        problems.append(f"data.path: data.source = {d.source!r} needs a file path")
    if rw.kind == "function" and not rw.function:
        problems.append("reward.function: reward.kind = 'function' needs module:function")
    if rw.function and ":" not in rw.function:
        problems.append(f"reward.function: {rw.function!r} must look like package.module:function")
    if rw.kind == "model" and not cfg.reward_model.enabled:
        problems.append("reward_model.enabled: reward.kind = 'model' needs the reward model role")
    if rw.workers < 0:
        problems.append(f"reward.workers: must be >= 0, got {rw.workers}")
    if rw.kind == "rule" and rw.rule == "math_verify" and not cfg.agent.enabled and (
            rw.executor != "process" or rw.workers < 1):
        problems.append("reward.executor: rule 'math_verify' grades in worker processes (math-verify's timeouts "
                        "use SIGALRM, which only a main thread can set): set reward.executor: process, workers >= 1")
    if rw.kind == "reasoning_gym" and d.source != "reasoning_gym":
        problems.append(f"reward.kind: 'reasoning_gym' scores reasoning-gym tasks but data.source = {d.source!r}")
    if cfg.sync.bucket_mb < 1:
        problems.append(f"sync.bucket_mb: must be >= 1, got {cfg.sync.bucket_mb}")
    if cfg.sync.transport == "ipc" and cfg.placement.mode != "colocated" and not one_shared_gpu(cfg):
        problems.append("sync.transport: ipc needs placement.mode = colocated (or one GPU shared disaggregated)")
    if cfg.sync.transport == "nccl" and cfg.placement.mode == "disaggregated" and one_shared_gpu(cfg):
        problems.append("sync.transport: nccl refuses two ranks on one GPU (trainer and rollout share it here); "
                        "use auto or ipc")
    if cfg.sync.transport == "nccl" and cfg.placement.mode == "colocated":
        problems.append("sync.transport: nccl refuses two ranks on one GPU (colocated, each sender's GPU also holds "
                        "a server rank of its update group); use auto or ipc (CUDA IPC)")
    if cfg.sync.expert_senders:
        if cfg.actor.parallel.ep < 2:
            problems.append(f"sync.expert_senders: needs actor.parallel.ep > 1 (every expert-parallel rank sends its "
                            f"own experts), got ep {cfg.actor.parallel.ep}")
        if push_transport(cfg) != "distributed":
            problems.append("sync.expert_senders: a broadcast push only (sync.transport nccl or gloo, or auto when "
                            "trainer and servers do not share a GPU); this run pushes by CUDA IPC or disk")
    if cfg.sync.colocated_gather == "node":
        if colocated_gather(cfg) == "none":
            problems.append("sync.colocated_gather: node applies to colocated CUDA-IPC pushes (placement.mode colocated, "
                            "sync.transport auto or ipc)")
        elif cfg.cluster.device == "cuda":
            p = cfg.actor.parallel
            misfit = node_gather_misfit(p.tp, p.ep, p.etp, max(cfg.cluster.gpus_per_node, 1))
            if misfit:
                problems.append(f"sync.colocated_gather: node needs every TP and expert-parallel group inside one node; "
                                f"{misfit}")
    if cfg.sync.transport == "nccl" and cfg.cluster.device != "cuda":
        problems.append("sync.transport: nccl needs cluster.device = cuda")
    if cfg.trainer.total_steps < 1:
        problems.append(f"trainer.total_steps: must be >= 1, got {cfg.trainer.total_steps}")
    if cfg.checkpoint.interval < 0:
        problems.append(f"checkpoint.interval: must be >= 0, got {cfg.checkpoint.interval}")
    if cfg.rollout.request_retries < 0:
        problems.append(f"rollout.request_retries: must be >= 0, got {cfg.rollout.request_retries}")
    if cfg.rollout.max_restarts < 0:
        problems.append(f"rollout.max_restarts: must be >= 0, got {cfg.rollout.max_restarts}")
    bound = cfg.rollout.logprob_diff_bound
    if bound is not None and bound <= 0:
        problems.append(f"rollout.logprob_diff_bound: must be > 0 or null (calibrated), got {bound}")
    if cfg.rollout.coalesce_max_samples < 1:
        problems.append(f"rollout.coalesce_max_samples: must be >= 1, got {cfg.rollout.coalesce_max_samples}")
    if any(s < 1 for s in cfg.logging.profile_steps):
        problems.append(f"logging.profile_steps: steps are counted from 1, got {cfg.logging.profile_steps}")
    odd = sorted(set(cfg.logging.profile_phases) - set(PROFILED_PHASES))
    if odd:
        problems.append(f"logging.profile_phases: unknown phase(s) {odd}; choose from {', '.join(PROFILED_PHASES)}")
    unknown = sorted(set(cfg.logging.sinks) - {"tensorboard", "jsonl", "wandb", "mlflow"})
    if unknown:
        problems.append(f"logging.sinks: unknown sink(s) {unknown}; choose from tensorboard, jsonl, wandb, mlflow")
    if cfg.checkpoint.keep_last < 0:
        problems.append(f"checkpoint.keep_last: must be >= 0 (0 keeps all), got {cfg.checkpoint.keep_last}")


def api_key_problem(key: str) -> str | None:
    """Why SGLang could not take this API key, or None. It travels as an HTTP Bearer token and
    through SGLang's --config file into argv, so whitespace, control characters and a leading '-'
    (argparse reads "--api-key -x" as a missing value) break one or the other."""
    if key.startswith("-"):
        return "an API key must not start with '-' (SGLang's argument parser reads it as an option)"
    if any(c.isspace() or not c.isprintable() for c in key):
        return "an API key must be printable without whitespace (it is sent as 'Bearer <key>')"
    return None


DEFAULT_API_KEY_ENV = RolloutConfig.__dataclass_fields__["api_key_env"].default


def api_key_env_problem(cfg: RunConfig) -> str | None:
    """The problem line for the key in ``rollout.api_key_env``'s variable, or None. Unset is fine
    only for the default variable (a fresh key for the servers megarl starts, none for
    ``rollout.server_urls``): a variable the recipe names was meant to hold the key, and without
    it a run against servers started with a key would die at its first weight push (401)."""
    name = cfg.rollout.api_key_env
    key = os.environ.get(name) if name else None
    if name and not key and name != DEFAULT_API_KEY_ENV:
        return (f"rollout.api_key_env: ${name} is not set; export {name}=<the servers' API key>, or leave "
                f"rollout.api_key_env at its default ({DEFAULT_API_KEY_ENV})")
    problem = api_key_problem(key) if key else None
    return f"rollout.api_key_env: ${name}: {problem}" if problem else None


def _check_paths(cfg: RunConfig, problems: list[str]) -> None:
    """Files and environment the run will use. Checked at launch, not by ``megarl config``, so a
    cluster recipe can be validated on a machine that does not hold its data."""
    key_problem = api_key_env_problem(cfg)
    if key_problem:
        problems.append(key_problem)
    for field_name, value in (("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path),
                              ("model.megatron_checkpoint", cfg.model.megatron_checkpoint)):
        if value and not Path(value).expanduser().exists():
            problems.append(f"{field_name}: {value!r} does not exist")
    hf = cfg.model.hf_path
    if not hf.startswith("builtin:") and hf_config_path(hf) is None:
        problems.append(f"model.hf_path: no config.json in {hf!r}")
    for name in ROLES:
        path = getattr(cfg, name).model_path
        if getattr(cfg, name).enabled and path and not path.startswith("builtin:") and hf_config_path(path) is None:
            problems.append(f"{name}.model_path: no config.json in {path!r}")
    from megarl.config.served import served_problems
    from megarl.config.teacher import teacher_path_problems

    problems.extend(teacher_path_problems(cfg))
    from megarl.config.judge import judge_path_problems

    problems.extend(judge_path_problems(cfg))
    rw = cfg.reward
    if rw.kind == "rule" and rw.rule == "math_verify" and importlib.util.find_spec("math_verify") is None:
        problems.append("reward.rule: 'math_verify' needs the math-verify package (pip install 'megarl[math]')")
    trained = hf_config_path(hf)
    problems.extend(served_problems(cfg, json.loads(trained.read_text()) if trained else None))
    if cfg.agent.enabled:
        for mount in sandbox_mounts(cfg.agent.env_args):
            if os.path.isabs(mount) and not os.path.exists(mount):
                problems.append(f"agent.env_args.mounts: {mount!r} does not exist")
        python = cfg.agent.env_args.get("python")
        if isinstance(python, str) and python and shutil.which(python) is None:
            problems.append(f"agent.env_args.python: no interpreter {python!r}")


def collect_problems(cfg: RunConfig, check_paths: bool = False) -> list[str]:
    problems: list[str] = []
    if check_paths:
        _check_paths(cfg, problems)
    resolve_arch(cfg, problems)
    for name in ROLES:
        role = getattr(cfg, name)
        if role.enabled:
            _check_parallel(name, role, cfg.model.arch, cfg.cluster.device, name in cfg.trained_roles, problems)
    _check_batches(cfg, problems)
    _check_cp_budget(cfg, problems)
    _check_pools(cfg, problems)
    _check_offload(cfg, problems)
    _check_algorithm(cfg, problems)
    _check_rollout_mode(cfg, problems)
    _check_rest(cfg, problems)
    _check_agent(cfg, problems)
    _check_lora(cfg, problems)
    from megarl.config.watchdog import watchdog_problems

    problems.extend(watchdog_problems(cfg))
    from megarl.config.teacher import teacher_problems

    problems.extend(teacher_problems(cfg))
    from megarl.config.judge import judge_problems

    problems.extend(judge_problems(cfg))
    return problems


def _check_lora(cfg: RunConfig, problems: list[str]) -> None:
    known = LoRAConfig().target_modules   # the default targets every supported projection
    for name in ("critic", "ref", "reward_model"):
        if getattr(cfg, name).lora.rank:
            problems.append(f"{name}.lora.rank: LoRA is for the actor only, got {getattr(cfg, name).lora.rank}")
    lo = cfg.actor.lora
    if lo.rank < 0:
        problems.append(f"actor.lora.rank: must be >= 0 (0 = off), got {lo.rank}")
    if not lo.rank:
        return
    if lo.alpha <= 0:
        problems.append(f"actor.lora.alpha: must be > 0, got {lo.alpha}")
    if not 0.0 <= lo.dropout < 1.0:
        problems.append(f"actor.lora.dropout: must be in [0, 1), got {lo.dropout}")
    unknown = sorted(set(lo.target_modules) - set(known))
    if unknown or not lo.target_modules:
        problems.append(f"actor.lora.target_modules: {unknown or 'empty'} not among {known}")
    if cfg.actor.parallel.sequence_parallel:
        problems.append("actor.lora.rank: LoRA with actor.parallel.sequence_parallel is not supported")
    if lo.push == "adapter":
        _check_adapter_push(cfg, problems)
    if cfg.ref.model_path:
        problems.append(f"ref.model_path: with actor.lora.rank > 0 the reference is the actor's base model; "
                        f"unset ref.model_path (got {cfg.ref.model_path!r})")


def _check_adapter_push(cfg: RunConfig, problems: list[str]) -> None:
    """Adapter-only pushes: tensors travel by shared memory from the trainer's process, and a
    request keeps the adapter it was admitted with (so its tokens' version is the one it started
    under: only exact when no push happens mid-request)."""
    if cfg.cluster.nodes > 1 and cfg.sync.transport != "disk":
        problems.append(f"actor.lora.push: adapter sends the adapters through shared memory on the trainer's node, "
                        f"but cluster.nodes={cfg.cluster.nodes}; set sync.transport=disk (a PEFT folder every node "
                        f"reads) or actor.lora.push=merged")
    if cfg.rollout.mode != "sync":
        problems.append(f"actor.lora.push: adapter needs rollout.mode=sync (a request in flight across a push keeps "
                        f"its old adapter, so per-token versions would be wrong), got {cfg.rollout.mode}")


def _check_agent(cfg: RunConfig, problems: list[str]) -> None:
    a = cfg.agent
    if not a.enabled:
        if a.entrypoint is not None:
            problems.append(f"agent.entrypoint: {a.entrypoint!r} is set but agent.enabled is false; set "
                            f"agent.enabled=true")
        return
    from megarl.envs.parsers import PARSERS
    from megarl.envs.registry import BUILTIN

    if a.entrypoint is not None:
        _check_entrypoint(cfg, problems)
    elif a.entrypoint_args:
        problems.append("agent.entrypoint_args: set without agent.entrypoint (they are its keyword arguments)")
    elif a.env not in BUILTIN and ":" not in a.env and "." not in a.env:
        problems.append(f"agent.env: unknown environment {a.env!r} (built-ins: {sorted(BUILTIN)}, or module:Class)")
    if a.tool_parser not in PARSERS and ":" not in a.tool_parser:
        problems.append(f"agent.tool_parser: unknown parser {a.tool_parser!r} (built-ins: {sorted(PARSERS)}, "
                        f"or module:function)")
    for name in ("max_turns", "max_response_tokens", "tool_workers"):
        if getattr(a, name) < 1:
            problems.append(f"agent.{name} must be at least 1, got {getattr(a, name)}")
    if a.tool_timeout_s <= 0:
        problems.append(f"agent.tool_timeout_s must be positive, got {a.tool_timeout_s}")
    if not cfg.data.chat_template:
        problems.append("data.chat_template: agent.enabled needs the chat template (turn boundaries come from it)")
    if cfg.reward.kind == "model":
        problems.append("reward.kind: model is not used with agent.enabled (the environment gives the reward)")
    if cfg.algorithm.overlong.enabled:
        problems.append("algorithm.overlong: DAPO's length penalty is single-turn; with agent.enabled use "
                        "agent.max_response_tokens")
    if a.env == "python" and float(a.env_args.get("wall_s", 10.0)) >= a.tool_timeout_s:
        problems.append(f"agent.env_args.wall_s ({a.env_args.get('wall_s', 10.0)}) must be below agent.tool_timeout_s "
                        f"({a.tool_timeout_s}): the sandbox, not the pool, must stop runaway code")
    _check_sandbox_mounts(cfg, problems)
    if a.env == "search" and "corpus" not in a.env_args:
        problems.append("agent.env_args.corpus: the search environment needs a corpus (JSONL file or list of passages)")


def _check_entrypoint(cfg: RunConfig, problems: list[str]) -> None:
    """A bring-your-own agent: an importable callable, and limits that can be met."""
    from megarl.envs.entrypoint import EntrypointError, check_call, load_entrypoint

    a = cfg.agent
    try:
        check_call(load_entrypoint(a.entrypoint), a.entrypoint_args)
    except EntrypointError as e:
        problems.append(str(e))
    if a.trajectory_timeout_s <= 0:
        problems.append(f"agent.trajectory_timeout_s must be positive, got {a.trajectory_timeout_s}")
    if a.concurrency < 1:
        problems.append(f"agent.concurrency must be at least 1, got {a.concurrency}")
    if not 0 <= a.gateway_port < 65536:
        problems.append(f"agent.gateway_port must be in [0, 65535], got {a.gateway_port}")


def sandbox_mounts(env_args: dict[str, Any]) -> list[str]:
    """``agent.env_args.mounts`` as a list of strings (what is not a string is reported by
    ``_check_sandbox_mounts``)."""
    mounts = env_args.get("mounts") or []
    return [m for m in mounts if isinstance(m, str)] if isinstance(mounts, list) else []


def _check_sandbox_mounts(cfg: RunConfig, problems: list[str]) -> None:
    """Tool code sees only the host paths named here: absolute paths, none holding the run's data,
    outputs, checkpoints or a home directory (a mount is an environment's fixtures, never its answers)."""
    mounts = cfg.agent.env_args.get("mounts")
    if mounts is None:
        return
    if not isinstance(mounts, list) or not all(isinstance(m, str) and m for m in mounts):
        problems.append(f"agent.env_args.mounts: must be a list of absolute paths, got {mounts!r}")
        return
    secret = [("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path), ("output_dir", cfg.output_dir),
              ("checkpoint.dir", cfg.checkpoint.dir)] + [("a home directory", h) for h in ("~", "/home", "/root")]
    for mount in mounts:
        if not os.path.isabs(mount):
            problems.append(f"agent.env_args.mounts: {mount!r} is not an absolute path")
            continue
        real = os.path.realpath(mount)
        for what, path in secret:
            held = os.path.realpath(os.path.abspath(os.path.expanduser(path))) if path else None
            if held and (held == real or held.startswith(real.rstrip("/") + "/")):
                problems.append(f"agent.env_args.mounts: {mount!r} would show tool code {what} ({path}); mount "
                                f"only the fixtures the environment needs")


def validate_config(cfg: RunConfig, check_paths: bool = False) -> RunConfig:
    """Raise ``ConfigError`` listing every problem; returns the config (arch filled) when valid.
    ``check_paths`` also requires the data and model files to exist (done at launch)."""
    problems = collect_problems(cfg, check_paths)
    if problems:
        raise ConfigError(problems)
    return cfg
