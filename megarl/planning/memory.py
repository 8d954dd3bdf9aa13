"""Per-GPU memory plan of a run: what each role and the rollout servers hold, phase by phase.

Everything is in bytes per GPU (per CPU rank when ``cluster.gpu_type: none``). The estimate is
deliberately simple and every term is printed, so a user can see which knob to turn.

Static state of a Megatron role (per GPU, for its largest pipeline stage)
    P = parameters on this GPU: attention/MLP / tp, routed experts / (ep * etp), norms and router
        replicated, embedding on the first stage, output layer (or tied copy) on the last one.
    params     = P * w                      w = 2 bytes (bf16/fp16) or 4 (fp32)
    grads      = P * 4                      fp32 main-grad buffer (megatron DDP with bf16 keeps
                                            fp32 grads; an fp32 model has fp32 grads anyway)
    optimizer  = P * (4 + 8) / d            fp32 master copy (not needed for fp32 models) + Adam
                                            m and v; d = data-parallel size with the distributed
                                            optimizer (expert-data-parallel size for routed
                                            experts), else 1. This is Megatron-LM's
                                            "6 + 12/d bytes per parameter" for bf16 (docs of the
                                            distributed optimizer).
    Frozen roles (ref, reward model, distillation teacher) hold params only; the teacher's are of
    its own network (``teacher.arch``), every other role's of the policy's (``model.arch``).

Activations (training, per GPU) -- Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", eq. (1)-(5): per layer and token, with tensor parallel t and sequence
parallel, the stored activations are (34 h + 5 a s) / t bytes for GPT with 2-byte values, where
the 5 a s term is the attention matrix; selective recomputation removes exactly that term, full
recomputation keeps only the 2 h-byte layer input. Our models differ from that paper's GPT
(GQA, SwiGLU of width f instead of 4h GELU, RMSNorm, no dropout, flash/SDPA attention that never
stores the s x s matrix), so the same bookkeeping gives, per layer and token (2-byte values):
    norm inputs 2*2h + QKV input 2h + MLP input 2h     = 8h          (/t with sequence parallel)
    attention Q, K, V, O (flash attention keeps them)  = 4q + 4kv    (/t)   q = heads*head_dim,
                                                                            kv = kv_heads*head_dim
    SwiGLU: gate and up outputs 4f + down input 2f     = 6f          (/t)
    MoE layer instead of the MLP: router logits 4E (fp32) + per routed copy (top-k per token)
        dispatched input 2h + expert output 2h + 6 f_e / etp, + shared experts 6 f_e n_s / t.
    (Check: MHA, f = 4h, no dropout masks gives 8h + 8h + 24h = 40h vs the paper's 34h + 5as/h
    with 2h of dropout masks and 16h of GELU in/out instead of our 24h of SwiGLU.)
  recompute none / selective: the above for every layer (selective = megatron's default
    "core_attn" recompute, which saves nothing more once attention is flash/SDPA: the s x s
    matrix the paper's selective recompute removes is never stored).
  recompute full: 2h per layer (/t with SP) for the layer inputs, plus one layer's activations
    while it is recomputed.
  Pipeline: with 1F1B the first stage holds activations of pp micro-batches (stage s: pp - s),
    times (1 + (pp - 1) / (pp * vpp)) with interleaving (same paper, section 4.2.3); capped by
    the number of micro-batches per step.
  Tokens per micro-batch and GPU: max_tokens_per_micro_batch (per CP rank: a packed micro-batch
    holds that x cp tokens over the CP group), else micro_batch_size * the longest sample
    (max_prompt_len + max_new_tokens, or + agent.max_response_tokens for agent trajectories) / cp.
  Context parallel (cp > 1): plus the K and V of the whole micro-batch that each layer gathers and
    keeps for attention's backward (as key prefixes per local chunk), (2 cp + 1) * tokens * kv * e
    bytes per layer; the exchange's bytes
    and seconds per layer are in the role's notes (``planning/context_parallel.py``).
  Output layer (last stage): logits for RL log-probs/entropy: tokens * vocab/t * (2 bf16 + 4 fp32
    log-softmax + 4 fp32 gradient) bytes. Critic/reward model heads are hidden -> 1 (no logits).
  fp32 models: all activation terms double (4-byte values).

Rollout (SGLang) per GPU of a server of tensor-parallel size r:
    weights = total params * w / r
    SGLang takes mem_fraction * GPU memory for weights + KV pool ("--mem-fraction-static").
    KV per token: GQA 2 * layers * ceil(kv_heads / r) * head_dim * 2 bytes; MLA (compressed
    latent, replicated on every TP rank) layers * (kv_lora_rank + 64) * 2 bytes.
    KV needed = max_running_requests * longest sample (as above) * KV per token.
Weight sync: about two buckets of max(bucket_mb, largest HF tensor) on each side.
Runtime: 1 GiB per process on a GPU (CUDA context, NCCL buffers, allocator slack), 2 GiB more for
    an SGLang server (CUDA graphs, forward activations of a prefill chunk) outside mem_fraction.

Phases:
    colocated (one pool; rollout memory released while training; each role's state switched by
    ``ROLE.offload.{params,grads,optimizer}`` waits on the host outside that role's passes):
    train:<role>, forward:<role>, rollout, sync; the GPU must hold the largest.
    Host, per node: pinned offloaded params and optimizer states (gradients are released, not
    copied), megatron's CPU optimizer share (``optim.cpu_offload_fraction``: fp32 main params, Adam
    moments and a pinned fp32 gradient copy), 4 GiB per GPU process, the embedded engine's
    released weights; checked against ``cluster.host_memory_gb``. Offload seconds per step are
    the pinned bytes over ``cluster.host_bandwidth_gbps``.
    disaggregated: trainer pool (actor + ref + reward model), critic pool, rollout pool, each its
    own peak.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from megarl.config.colocation import released_weights_resume_unpushed
from megarl.config.loader import ConfigError
from megarl.config.served import rollout_is_fp8
from megarl.config.schema import ModelArch, RoleConfig, RunConfig
from megarl.config.teacher import role_arch
from megarl.config.validate import dp_size, max_sequence_len
from megarl.planning.context_parallel import cp_exchange, suggest_cp
from megarl.planning.offload import offload_that_fits
from megarl.planning.lora import adapter_params, lora_state_bytes
from megarl.planning.refit import RefitPlan, plan_refit
from megarl.planning.params import (MLA_QK_NOPE, MLA_QK_ROPE, MLA_V, ModelParams, head_dim, is_mla,
                                    is_moe_layer, model_params, stage_shards)

GIB = 1024 ** 3
MIB = 1024 ** 2

# Memory of one GPU as CUDA reports it (nvidia-smi "Total", MiB). Names are matched
# case-insensitively; the short names (H100, H200, ...) are aliases of the first entry.
GPU_MIB = {
    "H100-80GB": 81559,
    "H100-94GB": 95830,
    "H200-141GB": 143771,
    "H20-96GB": 97871,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "B200-180GB": 183359,
    "GB200-186GB": 189471,
    "L40S-48GB": 46068,
}

RUNTIME_PER_PROCESS = 1 * GIB
SGLANG_EXTRA = 2 * GIB
CPU_RUNTIME_PER_PROCESS = int(0.5 * GIB)   # python + torch + megatron imports, per rank


def gpu_memory(gpu_type: str) -> Optional[int]:
    """Bytes of one GPU, None for CPU runs; raises ConfigError naming the known types."""
    name = gpu_type.strip().upper()
    if name in ("", "NONE", "CPU"):
        return None
    for key, mib in GPU_MIB.items():
        if name == key.upper() or name == key.split("-")[0].upper():
            return mib * MIB
    raise ConfigError([f"cluster.gpu_type: unknown GPU {gpu_type!r}; known: {', '.join(GPU_MIB)}, none"])


def host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def weight_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


@dataclass
class RolePlan:
    role: str
    layout: str
    trained: bool
    gpus: int
    dp: int
    expert_dp: int
    stage: int                  # the pipeline stage with the largest total (reported)
    params_on_gpu: int          # parameter count on that GPU
    params: int                 # bytes
    grads: int
    optimizer: int
    activations: int            # training (trained roles) or forward working set (frozen roles)
    logits: int
    offload: tuple[str, ...]    # kinds that leave the GPU between phases (colocated)
    host_optimizer: int = 0     # megatron's CPU optimizer: states, fp32 main params and grad copies on the host
    cp_kv_bytes_per_layer: int = 0      # context parallel: K/V bytes each rank receives per layer (forward)
    cp_kv_seconds_per_layer: float = 0.0   # forward all-gather + backward reduce-scatter, assumed bandwidth
    notes: list[str] = field(default_factory=list)
    stage_layers: list[int] = field(default_factory=list)   # layers on each pipeline rank (megatron's split)

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def resident(self) -> int:
        """What stays on the GPU while another role or the rollout runs."""
        return sum(getattr(self, k) for k in ("params", "grads", "optimizer") if k not in self.offload)

    @property
    def host_pinned(self) -> int:
        """Pinned host bytes of offloaded state (gradients are released, not copied)."""
        return sum(getattr(self, k) for k in ("params", "optimizer") if k in self.offload)

    @property
    def peak(self) -> int:
        return self.static + self.activations + self.logits


@dataclass
class RolloutPlan:
    gpus: int
    tp: int
    servers: int
    weights: int
    kv_per_token: int
    kv_needed: int
    kv_available: int           # mem_fraction * GPU - weights (GPU runs); = kv_needed on CPU
    reserved: int               # mem_fraction * GPU (what SGLang takes), or weights + KV on CPU
    seq_len: int
    concurrent_at_full_length: int
    weight_format: str = "bfloat16"   # the servers' weights: the model dtype, or fp8 (block FP8)
    notes: list[str] = field(default_factory=list)


@dataclass
class Phase:
    name: str
    pool: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Plan:
    recipe: str
    gpu_type: str
    device_bytes: int           # GPU memory, or host memory (CPU)
    cpu: bool
    placement: str
    total_params: int
    active_params: int
    roles: dict[str, RolePlan]
    rollout: RolloutPlan
    sync_buckets: int
    phases: list[Phase]
    nodes_needed: int
    nodes: int
    gpus_per_node: int
    problems: list[str]
    warnings: list[str]
    suggestions: list[str]
    host: dict[str, int] = field(default_factory=dict)   # host bytes per node, by part
    host_capacity: int = 0
    offload_seconds: float = 0.0    # per GPU, each way, per step, at cluster.host_bandwidth_gbps
    refit: Optional[RefitPlan] = None   # modelled seconds of one weight push (planning/refit.py)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        d = asdict(self)
        d["fits"] = self.fits
        for name, r in self.roles.items():
            d["roles"][name]["static"] = r.static
            d["roles"][name]["peak"] = r.peak
        d["phases"] = [dict(name=p.name, pool=p.pool, parts=p.parts, total=p.total) for p in self.phases]
        d["pools"] = self.pool_peaks()
        d["refit"] = self.refit.to_json() if self.refit else None
        return d

    def pool_peaks(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for p in self.phases:
            if p.pool not in out or p.total > out[p.pool]["total"]:
                out[p.pool] = {"phase": p.name, "total": p.total}
        for v in out.values():
            v["capacity"] = self.device_bytes
            v["headroom"] = self.device_bytes - v["total"]
        return out


# ----------------------------------------------------------------------------- activations
def _per_token_layer_bytes(arch: ModelArch, layer: int, role: RoleConfig, recompute: str, elem: int) -> float:
    """Stored activation bytes per token (of this GPU's micro-batch) for one layer."""
    p = role.parallel
    t = p.tp
    sp = p.sequence_parallel and t > 1
    h = arch.hidden_size
    if recompute == "full":
        return 2 * h * elem / 2 / (t if sp else 1)
    hsz = 8 * h / (t if sp else 1)
    nh = arch.num_attention_heads
    if is_mla(arch):
        qk = MLA_QK_NOPE + MLA_QK_ROPE
        attn = (2 * nh * qk + 2 * nh * qk + 2 * nh * MLA_V + 2 * nh * MLA_V) / t
        latent = 2 * (arch.q_lora_rank + arch.kv_lora_rank + MLA_QK_ROPE) / (t if sp else 1)
        attn += latent
    else:
        hd = head_dim(arch)
        kv_heads_per_rank = max(1, math.ceil(arch.num_kv_heads / t)) if t > 1 else arch.num_kv_heads
        attn = 4 * nh * hd / t + 4 * kv_heads_per_rank * hd
    if is_moe_layer(arch, layer):
        tokens_frac = 1 / t if (t > 1) else 1       # megatron MoE with TP requires SP: tokens / t
        fe = arch.moe_ffn_hidden_size
        mlp = 4 * arch.num_experts * tokens_frac
        mlp += arch.moe_top_k * tokens_frac * (4 * h + 6 * fe / p.etp)
        mlp += 6 * fe * arch.num_shared_experts / t
    else:
        mlp = 6 * arch.ffn_hidden_size / t
    return (hsz + attn + mlp) * elem / 2


def micro_batch_tokens(cfg: RunConfig, role: RoleConfig, forward_only: bool = False) -> int:
    """Tokens one GPU of ``role`` holds per micro-batch: the budget (per CP rank already; a forward
    pass's own budget when set), but at least the longest sample split over the CP group (a longer
    sample is packed alone, whatever the budget); without a budget ``micro_batch_size`` longest
    samples split over the CP group."""
    seq = max_sequence_len(cfg)
    cp = role.parallel.cp
    longest = math.ceil(seq / (2 * cp)) * 2 if cp > 1 else seq   # padded to 2 cp, one CP rank's share
    budget = (role.forward_max_tokens_per_micro_batch if forward_only else 0) or role.max_tokens_per_micro_batch
    if budget:
        return max(budget, longest)
    return math.ceil(role.micro_batch_size * seq / cp)


def _in_flight(cfg: RunConfig, role: RoleConfig, stage: int) -> float:
    p = role.parallel
    if p.pp <= 1:
        return 1
    seq = max_sequence_len(cfg)
    dp = max(dp_size(role), 1)
    samples = max(cfg.batch.global_batch_size // dp, 1)
    per_mb = role.max_tokens_per_micro_batch * p.cp if role.max_tokens_per_micro_batch else role.micro_batch_size * seq
    micro_batches = max(1, math.ceil(samples * seq / per_mb))
    n = min(p.pp - stage, micro_batches)
    if p.vpp > 1:
        n *= 1 + (p.pp - 1) / (p.pp * p.vpp)
    return n


# ----------------------------------------------------------------------------- roles
def plan_role(cfg: RunConfig, name: str) -> RolePlan:
    role: RoleConfig = getattr(cfg, name)
    arch = role_arch(cfg, name)
    p = role.parallel
    trained = name in cfg.trained_roles
    value_head = name in ("critic", "reward_model")
    mp = model_params(arch, value_head=value_head)
    w = weight_bytes(cfg.model.dtype)
    elem = w
    dp = max(dp_size(role), 1)
    edp = max(role.gpus // (p.pp * p.ep * p.etp), 1) if arch.num_experts else dp
    d_dense = dp if role.optim.distributed_optimizer else 1
    d_expert = edp if role.optim.distributed_optimizer else 1
    recompute = cfg.model.recompute if trained else "none"
    tokens = micro_batch_tokens(cfg, role)
    fwd_tokens = micro_batch_tokens(cfg, role, forward_only=True)
    forward_peak: dict[int, bool] = {}   # stage -> the forward pass, not training, sets its peak
    # the exchange reported: of a training micro-batch, or of a forward one for a role never trained
    exchange_tokens = tokens if trained else fwd_tokens
    exchange = cp_exchange(arch, role, exchange_tokens, elem, cfg.cluster.gpus_per_node, backward=trained)
    best: Optional[RolePlan] = None
    shards = stage_shards(arch, mp, p)
    for sh in shards:
        params = sh.total * w
        host_opt = 0
        if trained:
            grads = sh.total * 4
            master = 0 if w == 4 else 4
            optimizer = int(sh.dense * (master + 8) / d_dense + sh.expert * (master + 8) / d_expert)
            f = role.optim.cpu_offload_fraction
            if f > 0:   # HybridDeviceOptimizer: that fraction's Adam states and an fp32 copy of its main
                # params live (and update) on the host with a pinned fp32 copy of their gradients; the
                # distributed optimizer's fp32 main params stay on the GPU for every parameter (the
                # host result is copied back into them after each step; measured on the H200)
                shard = sh.dense / d_dense + sh.expert / d_expert
                host_opt = int(f * shard * (4 + 8 + 4))
                optimizer = int(shard * (4 + 8 * (1 - f)))
        else:
            grads = optimizer = 0
        if trained and name == "actor" and role.lora.rank:   # frozen base, trained adapters
            params, grads, optimizer, _ = lora_state_bytes(arch, role.lora, p.tp, sh.layers, sh.total, w, d_dense)
        per_token = [_per_token_layer_bytes(arch, i, role, recompute, elem) for i in sh.layers]
        if exchange is not None and recompute != "full":   # gathered K/V kept for the backward
            per_token = [b + exchange.gathered_kv_bytes / exchange_tokens for b in per_token]
        last = sh.stage == len(shards) - 1
        vocab_shard = math.ceil(arch.vocab_size / p.tp) if last and not value_head else 0
        # a forward-only pass: one layer's activations live at a time (with CP, its gathered K/V), the
        # logits and their fp32 chunk
        kv = exchange.gathered_kv_bytes / exchange_tokens if exchange is not None else 0.0
        one_layer = max((_per_token_layer_bytes(arch, i, role, "none", elem) for i in sh.layers), default=0)
        forward = (fwd_tokens * (one_layer + kv if sh.layers else 0), fwd_tokens * vocab_shard * (2 + 4))
        if trained:
            acts = tokens * sum(per_token) * _in_flight(cfg, role, sh.stage)
            if recompute == "full" and sh.layers:
                acts += tokens * one_layer
            logits = tokens * vocab_shard * (2 + 4 + 4)
            # (with its own budget only: the training estimate already covers a same-size forward)
            forward_peak[sh.stage] = fwd_tokens != tokens and sum(forward) > acts + logits
            if forward_peak[sh.stage]:   # a large forward budget sets this role's peak
                acts, logits = forward
        else:
            acts, logits = forward
        layout = f"tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else "") + (f" cp{p.cp}" if p.cp > 1 else "") \
            + (f" ep{p.ep} etp{p.etp}" if arch.num_experts else "") + f" dp{dp}" + (" sp" if p.sequence_parallel else "")
        rp = RolePlan(role=name, layout=layout, trained=trained, gpus=role.gpus, dp=dp, expert_dp=edp,
                      stage=sh.stage, params_on_gpu=sh.total, params=params, grads=grads, optimizer=optimizer,
                      activations=int(acts), logits=int(logits), offload=offload_kinds(role, trained),
                      host_optimizer=host_opt)
        if best is None or rp.peak > best.peak:
            best = rp
    assert best is not None
    best.stage_layers = [len(sh.layers) for sh in shards]
    if p.pp > 1:
        best.notes.append("layers per pipeline rank " + "/".join(map(str, best.stage_layers))
                          + (f" ({p.vpp} virtual chunks each)" if p.vpp > 1 else ""))
    if trained and not role.optim.distributed_optimizer and dp > 1:
        best.notes.append("optimizer states replicated on every data-parallel rank (distributed_optimizer: false)")
    if trained:
        best.notes.append(f"{tokens} tokens per micro-batch, recompute {recompute}")
    if fwd_tokens != tokens or not trained:
        best.notes.append(f"{fwd_tokens} tokens per forward-only micro-batch"
                          + (" (the peak: larger than training's)" if forward_peak.get(best.stage) else ""))
    if exchange is not None:
        best.cp_kv_bytes_per_layer = exchange.received_bytes
        best.cp_kv_seconds_per_layer = exchange.seconds
        best.notes.append(exchange.note(len(shards[best.stage].layers)))
    if trained and name == "actor" and role.lora.rank:
        trainable = adapter_params(arch, role.lora, p.tp, shards[best.stage].layers)
        best.notes.append(f"LoRA rank {role.lora.rank}: {trainable / 1e6:.2f}M trainable parameters on this GPU, "
                          f"base frozen (no gradients or optimizer state); the reference is the base, no ref role")
    return best


def offload_kinds(role: RoleConfig, trained: bool) -> tuple[str, ...]:
    """The switched-on kinds (null counts as off: `megarl train` resolves null before planning)."""
    kinds = ("params", "grads", "optimizer") if trained else ("params",)
    return tuple(k for k in kinds if getattr(role.offload, k))


def plan_rollout(cfg: RunConfig, mp: ModelParams, device: Optional[int]) -> RolloutPlan:
    r = cfg.rollout
    arch = cfg.model.arch
    tp = max(r.tp, 1)
    w = weight_bytes(cfg.model.dtype)
    fp8 = rollout_is_fp8(cfg)
    if fp8:
        # block FP8 (rollout.model_path / rollout.quantization): the attention and MLP projections
        # (experts too) at 1 byte + one fp32 scale per 128x128 block; norms, router, embedding and
        # LM head in the model dtype
        projections = sum(l.attention + l.mlp + l.experts for l in mp.layers)
        weights = math.ceil((projections * (1 + 4 / 128 ** 2) + (mp.total - projections) * w) / tp)
    else:
        weights = math.ceil(mp.total * w / tp)
    if is_mla(arch):
        kv_tok = arch.num_layers * (arch.kv_lora_rank + MLA_QK_ROPE) * w
    else:
        kv_heads = max(1, math.ceil(arch.num_kv_heads / tp))
        kv_tok = 2 * arch.num_layers * kv_heads * head_dim(arch) * w
    seq = max_sequence_len(cfg)
    needed = r.max_running_requests * seq * kv_tok
    if device is None:
        reserved = weights + needed
        available = needed
    else:
        reserved = int(r.mem_fraction * device)
        available = reserved - weights
    servers = max(r.num_servers, 1)
    gpus = r.gpus or tp * servers
    return RolloutPlan(gpus=gpus, tp=tp, servers=servers, weights=weights, weight_format="fp8" if fp8 else str(cfg.model.dtype),
                       kv_per_token=kv_tok,
                       kv_needed=needed, kv_available=available, reserved=reserved, seq_len=seq,
                       concurrent_at_full_length=max(available, 0) // max(kv_tok * seq, 1))


# ----------------------------------------------------------------------------- whole plan
def make_plan(cfg: RunConfig, recipe: str = "", gpu_memory_override: Optional[int] = None,
              suggest: bool = True) -> Plan:
    arch = cfg.model.arch
    if not arch.num_layers or not arch.hidden_size or not arch.vocab_size:
        raise ConfigError(["model.arch: num_layers, hidden_size and vocab_size are needed to plan "
                           "(state them in the recipe or point model.hf_path at a config.json)"])
    t = cfg.teacher.arch
    if "teacher" in cfg.megatron_roles and not (t.num_layers and t.hidden_size and t.vocab_size):
        raise ConfigError(["teacher.arch: num_layers, hidden_size and vocab_size are needed to plan "
                           "(state them in the recipe or point teacher.model_path at a config.json)"])
    device = gpu_memory_override if gpu_memory_override is not None else gpu_memory(cfg.cluster.gpu_type)
    cpu = device is None
    capacity = host_memory() if cpu else device
    mp = model_params(arch)
    roles = {n: plan_role(cfg, n) for n in cfg.megatron_roles}
    rollout = plan_rollout(cfg, mp, device)
    w = weight_bytes(cfg.model.dtype)
    bucket = max(cfg.sync.bucket_mb * MIB, mp.largest_tensor * w)
    buckets = 2 * bucket
    runtime = CPU_RUNTIME_PER_PROCESS if cpu else RUNTIME_PER_PROCESS
    problems: list[str] = []
    warnings: list[str] = []
    suggestions: list[str] = []
    phases: list[Phase] = []

    def resident(name: str) -> int:
        return roles[name].resident

    if cpu:
        # One host: every rank of every role plus the embedded server share its memory.
        ranks = {n: r.gpus for n, r in roles.items()}
        parts = {f"{n} x{ranks[n]} ranks": ranks[n] * (roles[n].peak + runtime) for n in roles}
        parts[f"rollout x{rollout.servers} servers"] = rollout.servers * (rollout.reserved + runtime)
        parts["sync buckets"] = buckets
        phases.append(Phase("all roles at peak", "host", parts))
    elif cfg.placement.mode == "colocated":
        n_proc = len(roles) + 1
        base = {"runtime": n_proc * runtime}
        for n, r in roles.items():
            others = {f"{o} resident": resident(o) for o in roles if o != n and resident(o)}
            kind = "train" if r.trained else "forward"
            phases.append(Phase(f"{kind}:{n}", "gpu", {**base, **others, f"{n} state": r.static,
                                                      f"{n} activations": r.activations, f"{n} logits": r.logits}))
        res = {f"{o} resident": resident(o) for o in roles if resident(o)}
        phases.append(Phase("rollout", "gpu", {**base, **res, "sglang mem_fraction": rollout.reserved,
                                               "sglang runtime": SGLANG_EXTRA}))
        actor_params = roles["actor"].params
        sync = {**base, **res}
        if "params" in roles["actor"].offload:
            sync["actor params (reloaded)"] = actor_params
        sync.update({"rollout weights": rollout.weights, "sync buckets (send+recv)": 2 * buckets})
        phases.append(Phase("sync", "gpu", sync))
    else:
        base = {"runtime": runtime}
        trainer_roles = [n for n in roles if n != "critic"]
        for n in roles:
            pool = "critic" if n == "critic" else "trainer"
            members = ["critic"] if n == "critic" else trainer_roles
            others = {f"{o} resident": resident(o) for o in members if o != n and resident(o)}
            r = roles[n]
            kind = "train" if r.trained else "forward"
            phases.append(Phase(f"{kind}:{n}", pool, {**base, "processes": (len(members) - 1) * runtime, **others,
                                                      f"{n} state": r.static, f"{n} activations": r.activations,
                                                      f"{n} logits": r.logits}))
        phases.append(Phase("sync (send)", "trainer", {**base, "processes": (len(trainer_roles) - 1) * runtime,
                                                        **{f"{o} resident": roles[o].static for o in trainer_roles},
                                                        "sync buckets": buckets}))
        phases.append(Phase("rollout", "rollout", {**base, "sglang mem_fraction": rollout.reserved,
                                                    "sglang runtime": SGLANG_EXTRA, "sync buckets (recv)": buckets}))

    host, host_capacity, offload_seconds = _host_plan(cfg, roles, rollout, cpu)
    if not cpu and sum(host.values()) > host_capacity:
        biggest = max(host.items(), key=lambda kv: kv[1])
        (problems if cfg.cluster.host_memory_gb else warnings).append(f"host: {sum(host.values()) / GIB:.1f} GiB per node of pinned/offloaded state, the node has "
                        f"{host_capacity / GIB:.1f} GiB (cluster.host_memory_gb{'' if cfg.cluster.host_memory_gb else ' not stated: this machine'}): short by "
                        f"{(sum(host.values()) - host_capacity) / GIB:.1f} GiB (largest part: {biggest[0]} "
                        f"{biggest[1] / GIB:.1f} GiB)")

    # ---- verdicts
    unit = "host memory" if cpu else f"one {cfg.cluster.gpu_type}"
    pools = {}
    for ph in phases:
        if ph.pool not in pools or ph.total > pools[ph.pool].total:
            pools[ph.pool] = ph
    for ph in phases:   # every phase that does not fit, largest first
        if ph.total <= capacity:
            continue
        role = ph.name.split(":", 1)[1] if ":" in ph.name else ph.name.split()[0]
        biggest = max(ph.parts.items(), key=lambda kv: kv[1])
        problems.append(
            f"{role}: phase '{ph.name}' needs {ph.total / GIB:.1f} GiB per "
            f"{'host' if cpu else 'GPU'}, {unit} has {capacity / GIB:.1f} GiB: short by "
            f"{(ph.total - capacity) / GIB:.1f} GiB (largest part: {biggest[0]} {biggest[1] / GIB:.1f} GiB)")
    problems.sort(key=lambda p: -float(p.split("short by ")[1].split()[0]) if "short by " in p else 0.0)
    if not cpu:
        if rollout.kv_available <= 0:
            problems.append(f"rollout: weights {rollout.weights / GIB:.1f} GiB per GPU (tp{rollout.tp}) exceed "
                            f"rollout.mem_fraction * GPU = {rollout.reserved / GIB:.1f} GiB: short by "
                            f"{-rollout.kv_available / GIB:.1f} GiB before any KV cache; raise rollout.tp or mem_fraction")
        elif rollout.concurrent_at_full_length < 1:
            problems.append(f"rollout: KV pool {rollout.kv_available / GIB:.2f} GiB per GPU holds less than one "
                            f"sequence of {rollout.seq_len} tokens ({rollout.kv_per_token * rollout.seq_len / GIB:.2f} GiB): "
                            f"short by {(rollout.kv_per_token * rollout.seq_len - rollout.kv_available) / GIB:.2f} GiB")
        elif rollout.kv_needed > rollout.kv_available:
            warnings.append(f"rollout: KV pool {rollout.kv_available / GIB:.1f} GiB per GPU holds "
                            f"{rollout.concurrent_at_full_length} sequences of {rollout.seq_len} tokens at full length, "
                            f"max_running_requests = {cfg.rollout.max_running_requests} would need "
                            f"{rollout.kv_needed / GIB:.1f} GiB (SGLang then runs fewer at a time; long tails slow down)")
    # ---- nodes
    gpn = cfg.cluster.gpus_per_node
    if cpu or not gpn:
        nodes_needed = 1
    elif cfg.placement.mode == "colocated":
        nodes_needed = math.ceil(max([r.gpus for r in roles.values()] + [rollout.gpus]) / gpn)
    else:
        nodes_needed = math.ceil((roles["actor"].gpus + (roles["critic"].gpus if "critic" in roles else 0)) / gpn) \
            + math.ceil(rollout.gpus / gpn)
    if nodes_needed > cfg.cluster.nodes:
        problems.append(f"cluster.nodes: the pools need {nodes_needed} nodes of {gpn} GPUs, the recipe has "
                        f"{cfg.cluster.nodes}: short by {nodes_needed - cfg.cluster.nodes} node(s)")
    plan = Plan(recipe=recipe, gpu_type=cfg.cluster.gpu_type, device_bytes=capacity, cpu=cpu,
                placement=cfg.placement.mode, total_params=mp.total, active_params=mp.active(arch), roles=roles,
                rollout=rollout, sync_buckets=buckets, phases=phases, nodes_needed=nodes_needed,
                nodes=cfg.cluster.nodes, gpus_per_node=gpn, problems=problems, warnings=warnings,
                suggestions=suggestions, host=host, host_capacity=host_capacity, offload_seconds=offload_seconds,
                refit=plan_refit(cfg, rollout.weight_format == "fp8", rollout.tp, rollout.servers))
    if problems and not cpu and suggest:
        suggestions.extend(_suggest(cfg, plan, recipe, gpu_memory_override))
    return plan


HOST_RUNTIME_PER_GPU_PROCESS = 4 * GIB   # a CUDA process's host side: python, torch, megatron, NCCL


def _host_plan(cfg: RunConfig, roles: dict[str, RolePlan], rollout: RolloutPlan,
               cpu: bool) -> tuple[dict[str, int], int, float]:
    """Host memory per node (GPU runs): every GPU of a node hosts one rank of each role (colocated;
    disaggregated: the trainer pool's GPUs), each with its pinned offloaded state and CPU optimizer
    share; the rollout servers keep their weights on the host while released when they come back
    unpushed (``released_weights_resume_unpushed``). Also the seconds one
    offload (and one onload) takes per GPU at the measured pinned bandwidth."""
    capacity = int(cfg.cluster.host_memory_gb * GIB) if cfg.cluster.host_memory_gb else host_memory()
    if cpu:
        return {}, capacity, 0.0
    gpn = max(cfg.cluster.gpus_per_node, 1)
    per_node = {}
    for n, r in roles.items():
        ranks = min(gpn, r.gpus)
        if r.host_pinned:
            per_node[f"{n} offloaded ({'+'.join(k for k in r.offload if k != 'grads')})"] = ranks * r.host_pinned
        if r.host_optimizer:
            per_node[f"{n} CPU optimizer"] = ranks * r.host_optimizer
        per_node[f"{n} processes"] = ranks * HOST_RUNTIME_PER_GPU_PROCESS
    if released_weights_resume_unpushed(cfg):   # --enable-weights-cpu-backup (SGLang, the embedded engine)
        per_node["rollout weights (released, host copy)"] = min(gpn, rollout.gpus) * rollout.weights
    moved = sum(r.host_pinned for r in roles.values())
    seconds = moved / (cfg.cluster.host_bandwidth_gbps * 1e9) if cfg.cluster.host_bandwidth_gbps > 0 else 0.0
    return per_node, capacity, seconds


def _grow(cfg: RunConfig, name: str, factor: int) -> None:
    """``factor`` times the GPUs of role ``name`` (colocated: of every role and the rollout pool,
    which share the GPUs)."""
    for r in (cfg.megatron_roles if cfg.placement.mode == "colocated" else [name]):
        getattr(cfg, r).gpus *= factor
    if cfg.placement.mode == "colocated":
        cfg.rollout.gpus *= factor
        cfg.rollout.num_servers *= factor


def _suggest(cfg: RunConfig, plan: Plan, recipe: str, override: Optional[int]) -> list[str]:
    """What would make it fit: more data-parallel ranks (shards the optimizer), or offload."""
    import copy
    out = []
    capacity = plan.device_bytes
    failing = {p.split(":", 1)[0] for p in plan.problems}
    for name in plan.roles:
        if name not in failing:
            continue
        role = getattr(cfg, name)
        if not role.optim.distributed_optimizer and name in cfg.trained_roles:
            out.append(f"{name}: set {name}.optim.distributed_optimizer=true to shard optimizer states over dp")
        cp = suggest_cp(cfg, name, lambda c: make_plan(c, recipe, override, suggest=False), _grow)
        if cp is not None:
            out.append(cp)
        for factor in (2, 4, 8, 16, 32):
            trial = copy.deepcopy(cfg)
            _grow(trial, name, factor)
            trial.cluster.nodes = 10 ** 6
            tp = make_plan(trial, recipe, override, suggest=False)
            if not any(p.startswith(name + ":") for p in tp.problems):
                out.append(f"{name}: fits with {name}.gpus={getattr(trial, name).gpus} (dp x{factor}, "
                           f"{tp.nodes_needed} node(s) of {cfg.cluster.gpus_per_node} GPUs)")
                break
        else:
            out.append(f"{name}: more data-parallel ranks alone do not make it fit: raise tp/pp/ep, "
                       f"use recompute: full, offload (colocated) or the CPU optimizer")
    if any(p.startswith("rollout:") for p in plan.problems):
        ro = plan.rollout
        phase = next((p for p in plan.phases if p.name == "rollout"), None)
        if phase is not None and plan.placement == "colocated":
            others = phase.total - ro.reserved
            device = ro.reserved / cfg.rollout.mem_fraction
            allowed = math.floor((capacity - others) / device * 20) / 20
            if allowed * device > ro.weights + ro.kv_per_token * ro.seq_len:
                out.append(f"rollout: rollout.mem_fraction={allowed:.2f} fits next to what stays resident")

        out.append("rollout: raise rollout.tp (weights / tp) or rollout.mem_fraction if the weights do not fit")
    switch = offload_that_fits(cfg, lambda c: make_plan(c, recipe, override, suggest=False))
    if switch is not None:
        out.insert(0, f"offload: fits with {switch.describe()}")
    return out
