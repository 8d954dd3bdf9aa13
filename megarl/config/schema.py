"""The one typed schema of a megarl run.

Every field has a type, a default and a one-line help (``metadata["help"]``): recipes are YAML files
of this tree, ``megarl config RECIPE`` prints it resolved, and the validator walks it. Sections
mirror the parts of ARCHITECTURE.md so a reader can go from a YAML key to the module that consumes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


def opt(default: Any, help: str) -> Any:
    """A dataclass field with a default and a help line (mutable defaults go through a factory)."""
    if isinstance(default, (list, dict)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def section(cls: type, help: str) -> Any:
    """A nested config section with its own defaults."""
    return field(default_factory=cls, metadata={"help": help})


Dtype = Literal["float32", "bfloat16", "float16"]
Family = Literal["auto", "llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]


@dataclass
class ModelArch:
    """Shape of the model. Filled from ``config.json`` when ``model.hf_path`` is readable (and
    checked against it); recipes for models not on disk state it so validation and ``megarl plan``
    work before any download."""

    num_layers: int = opt(0, "transformer layers (0 = read from config.json)")
    hidden_size: int = opt(0, "model width")
    ffn_hidden_size: int = opt(0, "dense MLP width")
    num_attention_heads: int = opt(0, "query heads")
    num_kv_heads: int = opt(0, "key/value heads (GQA); equal to query heads for MHA")
    head_dim: int = opt(0, "per-head width (0 = hidden_size / num_attention_heads)")
    vocab_size: int = opt(0, "vocabulary size")
    num_experts: int = opt(0, "routed experts per MoE layer (0 = dense model)")
    moe_ffn_hidden_size: int = opt(0, "width of one routed expert")
    moe_top_k: int = opt(0, "experts per token")
    num_shared_experts: int = opt(0, "always-on shared experts (DeepSeek-V3: 1)")
    first_k_dense: int = opt(0, "leading dense layers before MoE layers start (DeepSeek-V3: 3)")
    kv_lora_rank: int = opt(0, "MLA compressed KV width (0 = not MLA)")
    q_lora_rank: int = opt(0, "MLA compressed Q width (0 = no Q compression)")
    tie_word_embeddings: bool = opt(False, "output layer shares the embedding matrix")


@dataclass
class ModelConfig:
    hf_path: str = opt("builtin:smollm2-135m-instruct",
                       "HF folder (config.json + safetensors), or builtin:smollm2-135m-instruct")
    megatron_checkpoint: Optional[str] = opt(None, "start from this megatron torch_dist checkpoint instead of HF weights")
    family: Family = opt("auto", "architecture family; auto = from config.json model_type")
    tokenizer: Optional[str] = opt(None, "tokenizer folder (default: hf_path)")
    dtype: Dtype = opt("float32", "parameter/compute dtype of the trainer (bfloat16 on GPU)")
    recompute: Literal["none", "selective", "full"] = opt("none", "activation recomputation in training")
    fp32_lm_head: Optional[bool] = opt(None, "trainer computes the output projection in fp32 (logits fp32 from "
                                       "bf16 hidden states and weights); null = as rollout.fp32_lm_head, so both "
                                       "sides agree")
    arch: ModelArch = section(ModelArch, "model shape for validation and planning")


@dataclass
class ParallelConfig:
    tp: int = opt(1, "tensor-parallel size")
    pp: int = opt(1, "pipeline-parallel size")
    vpp: int = opt(1, "virtual pipeline chunks per pipeline rank (1 = off)")
    ep: int = opt(1, "expert-parallel size (MoE)")
    etp: int = opt(1, "expert tensor-parallel size (MoE)")
    cp: int = opt(1, "context-parallel size")
    sequence_parallel: bool = opt(False, "sequence parallelism with TP (needs tp > 1; not on CPU)")
    first_stage_layers: int = opt(0, "layers on the first pipeline stage when uneven (0 = even split)")
    last_stage_layers: int = opt(0, "layers on the last pipeline stage when uneven (0 = even split)")


@dataclass
class OptimConfig:
    lr: float = opt(1e-6, "peak learning rate")
    min_lr: float = opt(0.0, "floor of the LR schedule")
    weight_decay: float = opt(0.01, "decoupled weight decay (AdamW)")
    adam_beta1: float = opt(0.9, "AdamW beta1")
    adam_beta2: float = opt(0.999, "AdamW beta2")
    adam_eps: float = opt(1e-8, "AdamW epsilon")
    clip_grad: float = opt(1.0, "global grad-norm clip (0 = off)")
    warmup_steps: int = opt(0, "linear warm-up optimizer steps")
    lr_decay: Literal["constant", "cosine", "linear"] = opt("constant", "LR decay after warm-up")
    distributed_optimizer: bool = opt(True, "shard optimizer states over data-parallel ranks")
    cpu_offload_fraction: float = opt(0.0, "fraction of the optimizer states and their update kept on the CPU "
                                      "(megatron-core's HybridDeviceOptimizer; 1 = all, as verl's DeepSeek-V3 run); "
                                      "0 = off. GPU runs only, uses the distributed optimizer")


@dataclass
class OffloadConfig:
    """State of a Megatron role that leaves the GPU between phases (colocated runs) for pinned host
    memory, and comes back before the role's next pass. null = decided by the memory plan at launch
    (on only where the colocated layout needs it; `megarl train` says so in one line)."""

    params: Optional[bool] = opt(None, "model weights leave the GPU while other roles or the rollout run")
    grads: Optional[bool] = opt(None, "gradient buffers are released outside training (nothing is copied: they "
                                      "are zeroed before every mini-batch)")
    optimizer: Optional[bool] = opt(None, "fp32 main params and Adam moments leave the GPU outside training")


@dataclass
class LoRAConfig:
    """Low-rank adapters on the actor's linear layers (base frozen; the reference is the base)."""

    rank: int = opt(0, "adapter rank r (0 = full-parameter training)")
    alpha: float = opt(16.0, "scaling numerator: the update is (alpha / rank) * B A")
    dropout: float = opt(0.0, "dropout on the adapter input while training")
    target_modules: list[str] = opt(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    "HF projections that get an adapter (PEFT's target_modules; dense attention "
                                    "and MLP)")
    push: Literal["merged", "adapter"] = opt("merged", "weight push: merged = W + (alpha/r) B A under the HF names, any "
                                                       "server; adapter = the adapters only, through SGLang's LoRA API "
                                                       "(servers load the base checkpoint and start with --enable-lora; "
                                                       "tensors by shared memory on the trainer's node, or a PEFT "
                                                       "folder with sync.transport=disk)")


@dataclass
class RoleConfig:
    """One Megatron role (actor, critic, reference, reward model, teacher): its GPUs and parallel layout."""

    enabled: bool = opt(True, "whether this role runs")
    gpus: int = opt(1, "GPUs (ranks) in this role's pool; dp = gpus / (tp*pp*cp)")
    parallel: ParallelConfig = section(ParallelConfig, "parallel layout of this role")
    optim: OptimConfig = section(OptimConfig, "optimizer (trained roles only)")
    offload: OffloadConfig = section(OffloadConfig, "state moved to host memory between phases (colocated)")
    model_path: Optional[str] = opt(None, "weights for this role if not the policy's (critic/reward model)")
    micro_batch_size: int = opt(1, "sequences per micro-batch (when max_tokens_per_micro_batch = 0)")
    max_tokens_per_micro_batch: int = opt(0, "token budget per micro-batch (packed: tokens laid end to end; padded: "
                                             "samples x longest); 0 = packed: micro_batch_size x (max_prompt_len + "
                                             "max_new_tokens), padded: micro_batch_size samples")
    forward_max_tokens_per_micro_batch: int = opt(
        0, "token budget per micro-batch of forward-only passes (old/ref logprobs, values, scores): they keep no "
           "activations for a backward, so fewer, larger micro-batches fit (verl's log_prob_max_token_len_per_gpu); "
           "0 = max_tokens_per_micro_batch")
    packing: bool = opt(True, "pack whole sequences end to end into THD micro-batches (no padding compute); "
                              "false = pad each micro-batch to its longest sample")
    lora: LoRAConfig = section(LoRAConfig, "LoRA adapters (actor only; rank 0 = off)")


@dataclass
class TeacherConfig(RoleConfig):
    """The teacher of on-policy distillation: a frozen model that scores the student's sampled tokens
    (``algorithm.distill``). A forward-only Megatron role like the reference, of any size and layout
    (its own model_path, gpus, parallel, offload), or servers that return the logprobs of given
    tokens (SGLang's /generate with ``logprob_start_len``, or ``megarl serve``). Either way it must
    share the student's tokenizer (checked at launch)."""

    mode: Literal["megatron", "served"] = opt("megatron", "megatron: a forward-only role on the trainer's GPUs "
                                              "(teacher.gpus, parallel, offload); served: teacher.server_urls score "
                                              "the tokens (no Megatron role)")
    server_urls: list[str] = opt([], "mode served: running SGLang or `megarl serve` servers of teacher.model_path; "
                                 "a step's sequences are spread over them")
    api_key_env: str = opt("MEGARL_TEACHER_API_KEY", "mode served: environment variable holding the teacher "
                           "servers' API key (sent as Authorization: Bearer); unset = no key")
    request_batch: int = opt(16, "mode served: sequences per /generate scoring request")
    arch: ModelArch = section(ModelArch, "the teacher's shape for validation and `megarl plan` (filled from "
                                         "teacher.model_path's config.json when readable)")


@dataclass
class ClusterConfig:
    backend: Literal["local", "ray"] = opt("ray", "ray: one Ray actor per rank; local: in-process (tests, one GPU)")
    ray_address: Optional[str] = opt(None, "join this Ray cluster (auto, ray://host:port); None = start one")
    nodes: int = opt(1, "nodes in the job")
    gpus_per_node: int = opt(0, "GPUs per node (0 = CPU run)")
    device: Literal["cpu", "cuda"] = opt("cpu", "device of trainer ranks")
    gpu_type: str = opt("none", "GPU model for planning: H100-80GB, H200-141GB, A100-80GB, none")
    cpus_per_rank: float = opt(1.0, "Ray CPUs reserved per rank")
    object_store_mb: int = opt(256, "object store of a Ray cluster that megarl starts itself")
    host_memory_gb: float = opt(0.0, "host RAM per node (GiB) for the plan's host-memory check (offloaded state, "
                                "CPU optimizer); 0 = this machine's")
    mps: Literal["auto", "required", "disabled"] = opt("auto", "CUDA MPS when the trainer and one rollout server share one GPU "
                                            "(disaggregated, local backend): auto = use a running daemon or start "
                                            "one, or say in one line that it is not available; on = error if not")
    mps_trainer_sm_percent: Optional[int] = opt(None, "MPS: the trainer's share of the SMs "
                                                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); null = no limit")
    mps_rollout_sm_percent: Optional[int] = opt(None, "MPS: the rollout server's share of the SMs; null = no limit")
    mps_rollout_priority: Literal["normal", "below_normal"] = opt(
        "normal", "MPS: the rollout server's client priority (CUDA_MPS_CLIENT_PRIORITY); below_normal = the "
        "trainer's kernels are scheduled first and the rollout fills what is left (one_step_off/async)")
    host_bandwidth_gbps: float = opt(55.0, "pinned host<->device copy bandwidth per GPU (GB/s) for the plan's "
                                     "offload/onload seconds; 55 measured on an H200 (PCIe Gen5 x16)")
    collective_timeout_s: float = opt(1800.0, "timeout of every process group megarl creates for its Megatron ranks "
                                      "(a collective that waits longer fails, naming its group); above the "
                                      "watchdog's deadlines, so that the watchdog names a hung rank first")
    nvlink_gbps: float = opt(450.0, "in-node GPU-to-GPU bandwidth per GPU, one direction, in GB/s (bytes), for the "
                             "plan's refit seconds; 450 = NVLink 4 (H100/H200: 900 GB/s both directions)")
    network_gbps: float = opt(50.0, "cross-node bandwidth per GPU (one NIC), in GB/s (bytes), for the plan's refit "
                              "seconds; 50 GB/s = a 400 Gb/s NIC per GPU")


@dataclass
class PlacementConfig:
    mode: Literal["colocated", "disaggregated"] = opt("colocated", "share GPUs between training and rollout, or not")


@dataclass
class SamplingConfig:
    temperature: float = opt(1.0, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    top_k: int = opt(-1, "top-k sampling (-1 = off)")
    max_new_tokens: int = opt(256, "longest response")
    stop_token_ids: list[int] = opt([], "extra stop tokens besides the tokenizer's EOS")


@dataclass
class RolloutConfig:
    engine: Literal["embedded", "sglang"] = opt("embedded", "embedded server (CPU/CI) or SGLang servers")
    gpus: int = opt(0, "GPUs of the rollout pool (disaggregated) or shared (colocated)")
    tp: int = opt(1, "tensor-parallel size of one rollout server")
    num_servers: int = opt(1, "rollout servers; with GPUs: gpus / tp")
    server_urls: list[str] = opt([], "use already running servers instead of starting them")
    model_path: Optional[str] = opt(None, "checkpoint the rollout servers serve, when not model.hf_path: e.g. a block "
                                    "FP8 copy made by `megarl convert hf-to-fp8` (every push is then quantized to its "
                                    "format, and the rollout correction is on by default); null = model.hf_path")
    quantization: Optional[Literal["none", "fp8"]] = opt(None, "the served checkpoint's weight format for `megarl "
                                                         "plan` (fp8: block FP8, 1 byte per projection weight); "
                                                         "null = read from rollout.model_path's config.json")
    server_tp: list[int] = opt([], "per-server TP sizes, one per server (rollout.server_urls, or the num_servers "
                               "megarl starts; e.g. [1, 2]); empty: every server has rollout.tp")
    n_per_prompt: int = opt(8, "samples per prompt (group size)")
    max_prompt_len: int = opt(512, "prompts longer than this are dropped with a warning")
    sampling: SamplingConfig = section(SamplingConfig, "sampling parameters")
    mem_fraction: float = opt(0.7, "SGLang --mem-fraction-static")
    max_running_requests: int = opt(64, "concurrent sequences per server")
    request_timeout_s: float = opt(600.0, "per-request timeout")
    coalesce_max_samples: int = opt(64, "one_step_off/async: the samples of a group, issued together, go out as "
                                    "one batched /generate of at most this many items (each keeps its seed); "
                                    "1 = one request per sample")
    request_retries: int = opt(2, "times one generation request is sent again after failing on a server "
                                  "that still answers /health (a server that does not is dropped for the run)")
    max_restarts: int = opt(2, "restarts of one rollout server megarl started (dead, or hung: no /health answer) "
                            "over the run; a server needing more ends the run with an error after a checkpoint. "
                            "Servers given by rollout.server_urls are never restarted: a dead one is dropped")
    logprob_diff_bound: Optional[float] = opt(None, "step 0 fails if mean |rollout - trainer| logprob on the sampled "
                                              "tokens exceeds this; null = calibrated: 3x the measured noise floor "
                                              "of the trainer/rollout dtypes (bf16/bf16 0.13, fp32/fp32 4e-5; "
                                              "megarl/algos/fidelity.py)")
    api_key_env: str = opt("MEGARL_API_KEY", "environment variable holding the servers' API key (sent as "
                           "Authorization: Bearer); unset: a fresh key per run for servers megarl starts, none "
                           "for rollout.server_urls")
    server_command: list[str] = opt([], "command that starts one server, megarl appends its flags (default: "
                                    "python -m sglang.launch_server | python -m megarl.engine); e.g. a "
                                    "container wrapper")
    deterministic: bool = opt(False, "SGLang --enable-deterministic-inference: honours sampling_seed (reproducible "
                              "rollouts) with batch-invariant kernels, at a throughput cost; the embedded "
                              "server is always seeded")
    fp32_lm_head: bool = opt(False, "output projection and logprobs in fp32 (SGLang --enable-fp32-lm-head, the "
                             "embedded server's flag of the same name); the trainer follows unless "
                             "model.fp32_lm_head says otherwise")
    return_routed_experts: Optional[bool] = opt(None, "MoE: servers record the experts each token was routed to "
                                                "(SGLang --enable-return-routed-experts, request field "
                                                "return_routed_experts); null = on for MoE models")
    mode: Literal["sync", "one_step_off", "async"] = opt(
        "sync", "sync: generate each step's batch after the previous push; one_step_off: generate step k+1's batch "
        "(weights k) while step k trains; async: a producer keeps generating, batches at most max_staleness versions "
        "old (both need placement.mode=disaggregated)")
    max_staleness: int = opt(1, "async: the oldest token of a trained sample is at most this many weight versions "
                                "behind the trainer (one_step_off: 1)")
    interrupt: Literal["abort", "retract", "none"] = opt(
        "abort", "async: requests in flight at a weight push: abort (SGLang /pause_generation mode abort, answered with "
        "their tokens and continued by the client from them), retract (kept by the server, KV recomputed, continued "
        "under the new weights), none (the push waits for them)")
    stale_samples: Literal["drop", "downweight"] = opt(
        "drop", "async: groups whose oldest token is past max_staleness are dropped (counted), or kept with tokens "
        "past the bound weighted stale_weight per extra version")
    stale_weight: float = opt(0.5, "stale_samples=downweight: loss weight factor per version beyond max_staleness")


@dataclass
class KLConfig:
    mode: Literal["none", "loss", "reward"] = opt("none", "KL to the reference: off, as a loss term, or as a reward penalty")
    coef: float = opt(0.001, "KL coefficient (initial value when adaptive)")
    estimator: Literal["k1", "k2", "k3"] = opt("k3", "KL estimator (Schulman 2020)")
    adaptive: bool = opt(False, "adaptive coefficient (Ziegler et al. 2019)")
    target: float = opt(0.1, "target KL for the adaptive controller")
    horizon: int = opt(10000, "horizon of the adaptive controller")


@dataclass
class DynamicSamplingConfig:
    enabled: bool = opt(False, "DAPO: drop groups whose rewards are all equal, resample until full")
    max_rounds: int = opt(4, "rollout rounds per step before training on what was collected")


@dataclass
class OverlongConfig:
    enabled: bool = opt(False, "DAPO soft overlong punishment")
    buffer_len: int = opt(64, "penalty ramps over the last this-many tokens of max_new_tokens")
    penalty_factor: float = opt(1.0, "penalty at max length")


@dataclass
class RolloutCorrectionConfig:
    enabled: Optional[bool] = opt(None, "importance weights pi_old / pi_rollout on the policy loss; null = on where rollout "
                                  "and training differ by construction (block-FP8 servers, rollout.mode one_step_off or "
                                  "async) or when another field here is set, else off")
    level: Literal["token", "sequence", "geometric"] = opt(
        "token", "ratio each token is weighted by: its own, its sequence's product, or that product's geometric mean")
    mode: Literal["truncate", "mask"] = opt("truncate", "truncate: clamp the ratio to [lower, upper] (TIS); mask: "
                                            "weight 0 outside [lower, upper] (MIS; IcePop = token, 0.5, 5)")
    lower: Optional[float] = opt(None, "lower bound of the ratio (null = none)")
    upper: Optional[float] = opt(2.0, "upper bound of the ratio (null = none)")
    reweight: bool = opt(True, "mask mode: tokens inside the bounds weigh their ratio (false: 1, pure rejection)")


@dataclass
class DistillConfig:
    """On-policy distillation (needs teacher.enabled): each sampled token's advantage gets
    coef * -(log pi_student - log pi_teacher), beside reward_weight times the task reward's."""

    advantage: Literal["reverse_kl"] = opt("reverse_kl", "distillation advantage (megarl.algos registry): "
                                           "reverse_kl = -(log pi_student - log pi_teacher) per sampled token")
    coef: float = opt(1.0, "weight of the distillation advantage")
    baseline: Literal["none", "batch_mean"] = opt("none", "none: the per-token signal as it is (GKD, Thinking "
                                                   "Machines); batch_mean: minus its mean over the step's sampled "
                                                   "tokens (same expected gradient, lower variance: small batches)")
    reward_weight: float = opt(1.0, "weight of the task reward's advantage beside it; 0 = distillation alone "
                               "(rewards are still scored and logged)")


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo", "gae", "reinforce_plus_plus",
                       "reinforce_plus_plus_baseline", "remax"] = opt("grpo", "advantage estimator")
    policy_loss: Literal["ppo", "gspo", "clip_cov", "kl_cov"] = opt("ppo", "policy loss")
    clip_low: float = opt(0.2, "PPO lower clip epsilon")
    clip_high: float = opt(0.2, "PPO upper clip epsilon (DAPO clip-higher: 0.28)")
    dual_clip_c: Optional[float] = opt(None, "dual-clip constant c > 1 (None = off)")
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = opt("token-mean", "loss aggregation")
    norm_adv_by_std: bool = opt(True, "divide group-centred advantages by the group std (GRPO)")
    gamma: float = opt(1.0, "discount (GAE)")
    lam: float = opt(1.0, "GAE lambda")
    entropy_coef: float = opt(0.0, "entropy bonus coefficient")
    value_clip: float = opt(0.2, "critic value clipping range")
    tis_cap: Optional[float] = opt(None, "legacy: C > 0 is rollout_correction {enabled: true, level: token, mode: "
                                   "truncate, upper: C}; 0 = enabled: false; null = use rollout_correction")
    routing_replay: Literal["none", "rollout"] = opt("none", "MoE routing replay (R3): rollout = the actor's router "
                                                    "uses the experts the rollout chose for every token, in the "
                                                    "old-logprob and training passes (gates still trained); none = "
                                                    "its own choice (agreement reported as routing/agreement)")
    ppo_epochs: int = opt(1, "passes over each rollout batch")
    old_logprobs: Literal["recompute", "rollout"] = opt(
        "recompute", "old logprobs of the PPO ratio: recompute = a forward pass of the actor before training "
        "(the trainer's numerics); rollout = the servers' logprobs of the sampled tokens, no forward pass "
        "(slime's --use-rollout-logprobs; the fidelity check still runs one at the run's first step)")
    kl: KLConfig = section(KLConfig, "KL regularisation")
    rollout_correction: RolloutCorrectionConfig = section(RolloutCorrectionConfig, "rollout/training mismatch correction")
    dynamic_sampling: DynamicSamplingConfig = section(DynamicSamplingConfig, "DAPO dynamic sampling")
    overlong: OverlongConfig = section(OverlongConfig, "DAPO overlong reward shaping")
    distill: DistillConfig = section(DistillConfig, "on-policy distillation from teacher.*")


@dataclass
class BatchConfig:
    prompts_per_step: int = opt(8, "prompts drawn per RL step (rollout batch)")
    global_batch_size: int = opt(64, "samples per optimizer step (PPO mini-batch)")


@dataclass
class DataConfig:
    source: Literal["jsonl", "parquet", "reasoning_gym"] = opt("reasoning_gym", "prompt source")
    path: Optional[str] = opt(None, "train file (jsonl/parquet)")
    eval_path: Optional[str] = opt(None, "held-out file (jsonl/parquet)")
    prompt_key: str = opt("prompt", "field holding the prompt (string or chat messages)")
    answer_key: str = opt("answer", "field holding the reference answer")
    image_key: str = opt("images", "field holding a row's images (paths beside the file, bytes, data URLs) for the "
                         "prompt's <image> marks or image parts")
    chosen_key: str = opt("chosen", "preference data: field of the preferred response")
    rejected_key: str = opt("rejected", "preference data: field of the dispreferred response")
    task: str = opt("basic_arithmetic", "reasoning-gym task name")
    task_args: dict[str, Any] = opt({}, "keyword arguments of the reasoning-gym task")
    num_train: int = opt(2048, "generated train prompts (reasoning_gym)")
    num_eval: int = opt(64, "held-out prompts")
    chat_template: bool = opt(True, "wrap prompts with the tokenizer's chat template")
    system_prompt: Optional[str] = opt(None, "system message prepended in the chat template")
    shuffle: bool = opt(True, "reshuffle each epoch (deterministic from seed)")


@dataclass
class JudgeConfig:
    """A served model that grades responses (``reward.kind: judge``; megarl/rollout/judge.py)."""

    server_url: Optional[str] = opt(None, "a running judge server (SGLang or `megarl serve`: /generate on token "
                                    "ids); null = megarl starts one from judge.model_path")
    api_key_env: Optional[str] = opt(None, "environment variable holding server_url's API key (sent as "
                                     "Authorization: Bearer); a server megarl starts gets a fresh key")
    model_path: Optional[str] = opt(None, "HF folder of the judge model: served by megarl when server_url is "
                                    "null, and the tokenizer of the judge's prompts")
    tokenizer: Optional[str] = opt(None, "the judge's tokenizer (default: judge.model_path)")
    engine: Literal["auto", "embedded", "sglang"] = opt("auto", "server megarl starts: auto = rollout.engine")
    template: Optional[str] = opt(None, "judge prompt with {prompt}, {response} and {reference} (null: the "
                                  "default rubric, which asks for 'Score: N' with N from 0 to 10)")
    system_prompt: Optional[str] = opt(None, "system message of the judge's chat (chat: true)")
    chat: bool = opt(True, "wrap the prompt with the judge tokenizer's chat template")
    parser: str = opt("score", "grade parser: score (the last 'Score: N' in the answer, N mapped from "
                      "score_range to [0, 1]) or a dotted module:function(text) -> float (raise on unparsable)")
    score_pattern: str = opt(r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)", "parser score: regex whose group 1 is N")
    score_range: list[float] = opt([0.0, 10.0], "parser score: [lowest, highest] grade, mapped to [0, 1]; a grade "
                                   "outside it is unparsable")
    max_new_tokens: int = opt(256, "judge answer length at most (greedy sampling)")
    timeout_s: float = opt(60.0, "deadline of one judge request (a batch of samples); past it each of its "
                           "samples fails (reason judge_timeout)")
    batch_size: int = opt(8, "samples per /generate request")
    max_concurrency: int = opt(16, "judge requests in flight at once")
    context_length: int = opt(4096, "a server megarl starts: prompt + answer tokens per sequence")
    devices: list[int] = opt([], "a server megarl starts on a GPU run: GPU ids of the driver's node it runs on "
                             "(CUDA_VISIBLE_DEVICES, TP = their count), GPUs the run's pools do not use; empty "
                             "on CPU runs")


@dataclass
class RewardConfig:
    kind: Literal["rule", "reasoning_gym", "model", "function", "judge"] = opt(
        "reasoning_gym", "how samples are scored (judge: a served model grades them, reward.judge.*)")
    function: Optional[str] = opt(None, "dotted path module:function(sample) -> float for kind=function")
    rule: Literal["math_answer", "math_verify", "exact"] = opt(
        "math_answer", "rule for kind=rule: math_answer (megarl's parser: boxed, ####, <answer>, last number), "
        "math_verify (HF math-verify: LaTeX/sympy equivalence; needs megarl[math], reward.executor process), exact")
    format_reward: float = opt(0.0, "added when the answer is found in the expected format")
    workers: int = opt(8, "parallel reward workers scoring a batch, order kept (0 = score in the trainer's thread)")
    executor: Literal["thread", "process"] = opt("thread", "thread: any function, parallel while it waits (I/O, "
                                                 "subprocess, sandbox); process: CPU-bound Python scorers "
                                                 "(function and records must pickle)")
    retries: int = opt(0, "more tries of a sample whose reward failed (a function that raised or ran past "
                       "reward.timeout_s, a judge request that timed out or failed); then the sample is marked "
                       "failed: no advantage, no loss, never a 0")
    timeout_s: Optional[float] = opt(300.0, "deadline of one sample's reward function, from when a worker takes "
                                     "it; past it the sample fails (reason timeout), never a 0. Threads cannot "
                                     "be stopped and are abandoned; reward.executor process kills the worker. "
                                     "null = no deadline; reward.workers 0 has none")
    max_failed_steps: int = opt(3, "consecutive steps in which every sample failed before the run stops "
                                "(RewardsUnavailable); such a step trains nothing (0 = never stop)")
    judge: JudgeConfig = section(JudgeConfig, "LLM-as-judge reward (kind: judge)")


@dataclass
class AgentConfig:
    enabled: bool = opt(False, "multi-turn rollouts with tools and an environment (megarl/rollout/agent.py); the "
                        "environment's reward replaces reward.*")
    env: str = opt("calculator", "environment: calculator | python | search, or a dotted module:Class")
    env_args: dict[str, Any] = opt({}, "keyword options of the environment (python: sandbox limits cpu_s, wall_s, "
                                   "memory_mb, output_bytes, nproc, tmp_mb; mounts: absolute host paths tool code may "
                                   "read, read-only (fixtures, never answers; nothing else of the host is visible); "
                                   "python: interpreter of the tool code (default: the trainer's); "
                                   "search: corpus, top_k)")
    tool_parser: str = opt("hermes", "tool-call format of the chat template: hermes (Qwen/Hermes <tool_call>), "
                           "llama3_json, or a dotted module:function")
    max_turns: int = opt(4, "model turns per trajectory at most")
    max_response_tokens: int = opt(512, "tokens after the prompt per trajectory (model + environment) at most; "
                                   "each turn also stops at rollout.sampling.max_new_tokens")
    tool_timeout_s: float = opt(10.0, "deadline of one tool call; past it the trajectory is truncated (counted)")
    tool_workers: int = opt(16, "threads running tool calls")
    entrypoint: Optional[str] = opt(None, "bring your own agent: package.module:function or path/to/file.py:function, "
                                    "called once per trajectory as function(base_url=, api_key=, record=) with an "
                                    "OpenAI-compatible gateway in front of the rollout servers (docs/byo-agent.md); "
                                    "returns the reward, or None to score the last call's text with reward.*. "
                                    "Replaces agent.env")
    entrypoint_args: dict[str, Any] = opt({}, "entrypoint: keyword arguments passed to it on every call besides "
                                          "base_url, api_key and record (an environment hub adapter's environment "
                                          "and its options: docs/byo-agent.md)")
    trajectory_timeout_s: float = opt(600.0, "entrypoint: deadline of one trajectory from its agent's start; past "
                                      "it the sample fails (agent_timeout), never a 0")
    concurrency: int = opt(64, "entrypoint: agent functions running at once (threads)")
    segments: Literal["all", "last"] = opt("all", "entrypoint: when the agent rewrote its history mid-trajectory "
                                           "(a new segment), train every segment as a sample with the "
                                           "trajectory's reward (all) or only the last one (last)")
    gateway_host: str = opt("127.0.0.1", "entrypoint: address the gateway binds (agents on this host only by "
                            "default; each trajectory has its own key either way)")
    gateway_port: int = opt(0, "entrypoint: gateway port (0 = a free one)")


@dataclass
class SyncConfig:
    bucket_mb: int = opt(512, "weight-sync bucket size in MiB (peak extra memory ~2 buckets)")
    transport: Literal["auto", "nccl", "gloo", "ipc", "disk"] = opt("auto", "auto: ipc if colocated on GPU, nccl/gloo broadcast otherwise")
    verify_checksum: Optional[bool] = opt(None, "server verifies a checksum per bucket; null = on when bytes are "
                                                "copied on the way (nccl/gloo/disk), off for ipc (the server "
                                                "reads the trainer's own buffer)")
    expert_senders: bool = opt(False, "broadcast push (nccl/gloo) with actor.parallel.ep > 1: every expert-parallel "
                               "rank sends its own experts through an update group of its own, in parallel with "
                               "its stage's sender (no expert gather to one rank; `megarl plan` models both)")
    colocated_gather: Literal["auto", "node", "everywhere"] = opt(
        "auto", "colocated CUDA-IPC push across nodes: node = each pipeline stage's tensors cross to every other node "
        "once (its ranks take turns) and are shared inside the node; everywhere = every rank fetches the whole model "
        "itself; auto = node when the run spans nodes and every TP and expert-parallel group fits inside one")


@dataclass
class CheckpointConfig:
    dir: Optional[str] = opt(None, "checkpoint folder (default: OUTPUT_DIR/checkpoints)")
    interval: int = opt(0, "save every N steps (0 = only at the end)")
    resume: str = opt("auto", "auto: latest in dir if any; none; or a checkpoint path")
    keep_last: int = opt(2, "newest checkpoints kept, older ones deleted (0 = keep all)")
    export_hf: bool = opt(True, "export the final actor as an HF folder")
    final: bool = opt(True, "write a checkpoint when the run ends (false: benchmarks, runs too large for the disk)")


@dataclass
class WatchdogConfig:
    enabled: bool = opt(True, "a deadline on every phase of a step; past it every rank's stack goes to "
                        "OUTPUT_DIR/watchdog/, one line names role, rank, host and phase, and the run exits "
                        "75 (launch/slurm requeues it)")
    factor: float = opt(4.0, "a phase's deadline: factor x its longest time so far in this run")
    first_step_s: float = opt(1500.0, "deadline of a phase that has not finished once yet in this run (first "
                              "step: warm-up, first checkpoint write)")
    min_s: float = opt(300.0, "no history-derived deadline is shorter than this")
    phase_s: dict[str, float] = opt({}, "fixed deadlines in seconds for named phases (rollout, release, "
                                    "old_logprobs, ref_logprobs, teacher_logprobs, values, train, sync, "
                                    "checkpoint, eval), history ignored")


@dataclass
class LoggingConfig:
    sinks: list[str] = opt(["tensorboard"], "where per-step metrics go, same names in each: tensorboard, jsonl "
                           "(OUTPUT_DIR/metrics.jsonl, floats exact), wandb "
                           "(offline unless logging.wandb_mode says online), mlflow (local file store unless "
                           "logging.mlflow_uri says otherwise)")
    tensorboard_dir: Optional[str] = opt(None, "event files (default: OUTPUT_DIR/tensorboard)")
    project: str = opt("megarl", "W&B project / MLflow experiment name (the run is named after `name`)")
    wandb_mode: Literal["offline", "online"] = opt("offline", "W&B mode: offline writes OUTPUT_DIR/wandb only "
                                                   "(`wandb sync` uploads it later); online needs a login")
    wandb_dir: Optional[str] = opt(None, "W&B run files (default: OUTPUT_DIR)")
    mlflow_uri: Optional[str] = opt(None, "MLflow tracking URI (default: file store OUTPUT_DIR/mlruns)")
    log_interval: int = opt(1, "console line every N steps")
    progress_bar: bool = opt(True, "console progress bar")
    profile_steps: list[int] = opt([], "steps (1-based) whose phases run under torch.profiler: a table of the top "
                                   "operations and a Chrome trace per phase, of the trainer's process (local "
                                   "backend: the actor's ranks included; Ray: the driver only)")
    profile_phases: list[str] = opt([], "phases to profile in those steps (rollout, release, old_logprobs, "
                                    "ref_logprobs, values, train, sync); empty = all")
    profile_dir: Optional[str] = opt(None, "profile tables and traces (default: OUTPUT_DIR/profile)")


@dataclass
class TrainerConfig:
    mode: Literal["rl", "reward_model"] = opt("rl", "rl: policy optimisation; reward_model: Bradley-Terry on preference pairs")
    total_steps: int = opt(100, "RL steps (reward_model mode: optimizer steps)")
    eval_interval: int = opt(0, "held-out evaluation every N steps (0 = before and after only)")
    eval_before_after: bool = opt(True, "evaluate before the first and after the last step")


@dataclass
class RunConfig:
    name: str = opt("megarl", "run name")
    output_dir: str = opt("outputs/megarl", "where checkpoints, logs and exports go")
    seed: int = opt(1234, "global seed (data order, sampling, init)")
    model: ModelConfig = section(ModelConfig, "the policy model")
    cluster: ClusterConfig = section(ClusterConfig, "nodes, GPUs and the Ray backend")
    placement: PlacementConfig = section(PlacementConfig, "colocated or disaggregated roles")
    actor: RoleConfig = section(RoleConfig, "policy being trained")
    critic: RoleConfig = section(lambda: RoleConfig(enabled=False), "value model (GAE/PPO)")
    ref: RoleConfig = section(lambda: RoleConfig(enabled=False), "frozen reference for KL")
    reward_model: RoleConfig = section(lambda: RoleConfig(enabled=False), "learned reward model")
    teacher: TeacherConfig = section(lambda: TeacherConfig(enabled=False), "frozen teacher for on-policy "
                                     "distillation (algorithm.distill)")
    rollout: RolloutConfig = section(RolloutConfig, "rollout servers and sampling")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "RL algorithm")
    batch: BatchConfig = section(BatchConfig, "batch sizes")
    data: DataConfig = section(DataConfig, "prompt data")
    reward: RewardConfig = section(RewardConfig, "reward")
    agent: AgentConfig = section(AgentConfig, "multi-turn agentic rollouts: environment, tools, turn limits")
    sync: SyncConfig = section(SyncConfig, "trainer -> rollout weight sync")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints and resume")
    logging: LoggingConfig = section(LoggingConfig, "tensorboard and console")
    watchdog: WatchdogConfig = section(WatchdogConfig, "phase deadlines: a hung rank is named, its stacks "
                                       "dumped, the run requeued")
    trainer: TrainerConfig = section(TrainerConfig, "loop length and evaluation")

    @property
    def trained_roles(self) -> list[str]:
        return [r for r in ("actor", "critic") if getattr(self, r).enabled]

    @property
    def megatron_roles(self) -> list[str]:
        """Roles that build a megatron model (with LoRA the reference is the actor's base: no role; a
        served teacher is servers, no role)."""
        return [r for r in ("actor", "critic", "ref", "reward_model", "teacher") if getattr(self, r).enabled
                and not (r == "ref" and self.actor.lora.rank > 0)
                and not (r == "teacher" and self.teacher.mode == "served")]
