"""Actor train step of a megatron GPTModel (megarl's build_model: local spec + SDPA attention),
tokens/s and MFU against the bf16 matmul peak measured in the same run (one JSON line per config).

    python benchmarks/bench_train.py                                 # CPU: tiny shape, fp32
    python benchmarks/bench_train.py --shape qwen2.5-0.5b --seq 4096 --mbs 1 --num-mb 4   # GPU, bf16
    python benchmarks/bench_train.py --lengths real                  # packed vs padded, RL length mix
    python benchmarks/bench_train.py --lengths real --device cuda --shape qwen2.5-1.5b   # same on GPU

``--lengths real``: one batch of samples with a realistic RL length mix (prompts of ``--prompt-len``
tokens, log-normal response lengths with mean ``--mean-response``, clipped to ``--max-response``;
GPU default mean 1k / max 8k, CPU mean 64 / max 512) trained for one optimizer step per repeat,
once with packed micro-batches (sequences end to end up to ``--tokens-per-mb``, megarl's THD path)
and once padded (token-budgeted dynamic batching, each micro-batch padded to its longest sample,
``samples x longest <= --tokens-per-mb``), the micro-batch inputs built by the workers' own code
(megarl/workers/batch.py). Reported: useful (real, unpadded) tokens/s of each, their ratio, and
model FLOPs of the real tokens (attention counted per sequence) per second vs the measured peak.

Model: random init (no weights needed), HF-config shapes built with transformers' Qwen2Config.
Loss: ``actor`` = megarl's vocab-parallel logprobs (+ entropy) of every next token, the RL actor's
path (workers/vocab_parallel.py); ``lm`` = megatron's own fused cross-entropy with labels.
Optimizer: megatron's (bf16 params, fp32 main params, torch AdamW without TE/apex) behind
megatron DDP, i.e. what MegatronWorker builds.  ``--profile`` writes the top CUDA kernels of one
step to a text file and adds a grouped summary to the JSON line.

FLOPs counted (model FLOPs, no recompute): 6 * (linear params incl. lm head) per token +
attention 6 * 2 * s * heads * head_dim per token per layer (causal half of QK^T and PV, fwd+bwd).
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    # Qwen/Qwen2.5-0.5B config.json
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2.5-1.5B
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2.5-3B
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen/Qwen2.5-7B (weight-sync size set)
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # SmolLM2-135M's layer count and head layout at a hidden size too small to compute anything: the
    # step time is the host's (Python, dispatch, launches), what a 135M model's train phase waits on
    "host-smollm2": dict(hidden_size=72, intermediate_size=192, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=1024, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}


def hf_config(shape: str):
    from transformers import Qwen2Config
    return Qwen2Config(max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       **SHAPES[shape])


def init_one_rank(cuda: bool) -> None:
    """torch.distributed and megatron's parallel state for one rank in this process (benchmarks)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from megarl.wire.addresses import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    if cuda:
        torch.cuda.set_device(0)
    from megarl.parallel import init_distributed, init_model_parallel
    init_distributed()
    init_model_parallel(tp=1, pp=1, seed=1234)


def model_flops_per_token(c, seq: int) -> float:
    h, L, V = c.hidden_size, c.num_hidden_layers, c.vocab_size
    nq, nk = c.num_attention_heads, c.num_key_value_heads
    d = h // nq
    lin = L * (h * nq * d + 2 * h * nk * d + nq * d * h + 3 * h * c.intermediate_size) + h * V
    attn = L * 2 * seq * nq * d  # causal: half of (QK^T + PV) = 2 * s * nq * d MACs... as FLOPs: 2*(2*s*nq*d)/2
    return 6.0 * lin + 3.0 * 2.0 * attn


def measure_matmul_peak(device, dtype, n=8192, iters=20) -> float:
    if device.type != "cuda":
        n, iters = 512, 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n ** 3 * iters / (time.perf_counter() - t)


def use_cuda(device: str) -> bool:
    """``--device auto|cpu|cuda`` -> run on CUDA? Asking for CUDA on a box without it is a one-line
    error before anything is built, not a failure deep inside megatron's setup."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(step, warmup: int, steps: int, device) -> tuple[float, list[float]]:
    """Median and all wall seconds of `steps` calls after `warmup` ones, the device synchronized
    around each (CUDA peak-memory stats reset after the warm-up)."""
    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2], times


def graph_timed(fn, device, repeats: int):
    """``fn``'s output and median seconds as a decode graph runs it: warmed up twice (Triton
    compiles, the allocator settles), captured once in a CUDA graph and replayed ``repeats`` times.
    On CPU (Triton's interpreter, a smoke run) it is called directly, without warm-up."""
    for _ in range(2):
        fn()
    sync(device)
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        step = graph.replay
    else:
        out, step = fn(), fn
    sync(device)
    med, _ = timed_steps(step, 3 if device.type == "cuda" else 0, repeats, device)
    return out, med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=None, help=f"one of {sorted(SHAPES)} (default: tiny on CPU, qwen2.5-0.5b on GPU)")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--mbs", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--num-mb", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--loss", default="actor", choices=["actor", "lm"])
    ap.add_argument("--recompute", default=None, choices=[None, "selective", "full"])
    ap.add_argument("--profile", default=None, help="write top kernels of one step to this file")
    ap.add_argument("--bf16-grads", action="store_true", help="DDP grad buffer in bf16 (grad_reduce_in_fp32=False)")
    ap.add_argument("--peak", type=float, default=None, help="skip the matmul measurement, use this FLOP/s")
    ap.add_argument("--no-fusions", action="store_true",
                    help="MEGARL_FUSIONS=0: eager RMSNorm/RoPE/SwiGLU/logprob chunks (megarl/models/fusions.py)")
    ap.add_argument("--lengths", default="fixed", choices=["fixed", "real"],
                    help="fixed: --mbs x --seq random tokens; real: packed vs padded on an RL length mix")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--samples", type=int, default=None, help="--lengths real: samples per step (GPU 64, CPU 32)")
    ap.add_argument("--prompt-len", type=int, default=None, help="--lengths real: prompt tokens (GPU 256, CPU 16)")
    ap.add_argument("--mean-response", type=int, default=None, help="--lengths real: mean response (GPU 1024, CPU 64)")
    ap.add_argument("--max-response", type=int, default=None, help="--lengths real: longest response (GPU 8192, CPU 512)")
    ap.add_argument("--tokens-per-mb", type=int, default=None, help="--lengths real: micro-batch token budget "
                                                                     "(GPU 16384, CPU 1024)")
    a = ap.parse_args()
    if a.no_fusions:
        os.environ["MEGARL_FUSIONS"] = "0"
    cuda = use_cuda(a.device)
    device = torch.device("cuda" if cuda else "cpu")
    shape = a.shape or ("qwen2.5-0.5b" if cuda else "tiny")
    seq = a.seq or (4096 if cuda else 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if not cuda:
        torch.set_num_threads(2)
    init_one_rank(cuda)
    peak = a.peak or measure_matmul_peak(device, dtype)

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models import build_model
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    cfg = hf_config(shape)
    over = {}
    if a.recompute == "selective":
        over.update(recompute_granularity="selective")
    elif a.recompute == "full":
        over.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    chunks = build_model(cfg, params_dtype=dtype, **over)
    model = chunks[0].to(device)
    model.config.variable_seq_lengths = True
    nparams = sum(p.numel() for p in model.parameters())
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=not a.bf16_grads, overlap_grad_reduce=False,
                                            use_distributed_optimizer=cuda)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, weight_decay=0.01, clip_grad=1.0,
                                                 bf16=cuda, params_dtype=dtype, use_distributed_optimizer=cuda),
                                 [ddp])
    if a.lengths == "real":
        ddp.train()
        return bench_real_lengths(a, cfg, ddp, opt, device, dtype, peak, nparams, shape, cuda)
    g = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    data = [torch.randint(0, V, (a.mbs, seq + 1), generator=g).to(device) for _ in range(a.num_mb)]
    pos = torch.arange(seq, device=device)[None].expand(a.mbs, seq)

    def step_fn(it, m):
        x = next(it)
        ids, tgt = x[:, :-1], x[:, 1:]
        if a.loss == "lm":
            out = m(ids, pos, None, labels=tgt)

            def loss_fn(o):
                loss = o.float().mean()
                return loss, {"loss": loss.detach()}
            return out, loss_fn
        out = m(ids, pos, None)

        def loss_fn(o):
            lp, ent = logprobs_and_entropy(o, tgt, V, with_entropy=True)
            loss = -lp.mean() - 0.0 * ent.mean()
            return loss, {"loss": loss.detach()}
        return out, loss_fn

    fb = get_forward_backward_func()

    def train_step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=step_fn, data_iterator=iter(data), model=ddp, num_microbatches=a.num_mb,
           seq_length=seq, micro_batch_size=a.mbs, forward_only=False)
        ok, gn, _ = opt.step()
        return gn

    ddp.train()
    st, times = timed_steps(train_step, a.warmup, a.steps, device)
    tokens = a.mbs * a.num_mb * seq
    flops = model_flops_per_token(cfg, seq) * tokens
    res = {"bench": "train_step", "shape": shape, "params": nparams, "dtype": str(dtype).replace("torch.", ""),
           "seq": seq, "mbs": a.mbs, "num_mb": a.num_mb, "loss": a.loss, "recompute": a.recompute, "bf16_grads": a.bf16_grads,
           "fusions": not a.no_fusions,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "step_s_median": st, "step_s_all": [round(x, 4) for x in times], "tokens_per_s": tokens / st,
           "model_tflops_per_s": flops / st / 1e12, "matmul_peak_tflops": peak / 1e12,
           "mfu_vs_measured_peak": flops / st / peak}
    if cuda:
        res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if a.profile:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            train_step()
            sync(device)
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        ev = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
        ev.sort(key=lambda e: -getattr(e, key))
        total = sum(getattr(e, key) for e in ev) or 1
        with open(a.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=40))
        groups = {}
        for e in ev:
            n = e.key.lower()
            grp = ("gemm" if any(s in n for s in ("gemm", "matmul", "mm", "cutlass", "nvjet", "sm90_xmma")) else
                   "attention" if any(s in n for s in ("flash", "attention", "fmha", "sdpa", "efficient")) else
                   "optimizer" if any(s in n for s in ("adam", "foreach", "multi_tensor")) else
                   "copy" if any(s in n for s in ("copy", "memcpy", "cat", "memset")) else
                   "elementwise/reduce")
            groups[grp] = groups.get(grp, 0) + getattr(e, key)
        res["profile_share"] = {k: round(v / total, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}
        res["profile_top"] = [(e.key[:60], round(getattr(e, key) / total, 3)) for e in ev[:8]]
    print(json.dumps(res), flush=True)


def rl_lengths(n: int, prompt: int, mean: int, longest: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths: log-normal responses (sigma 1, mean ``mean``) clipped to ``longest``."""
    import math
    import random

    g = random.Random(seed)
    sigma = 1.0
    mu = math.log(mean) - sigma ** 2 / 2
    return [(prompt, max(1, min(longest, int(g.lognormvariate(mu, sigma))))) for _ in range(n)]


def bench_real_lengths(a, cfg, ddp, opt, device, dtype, peak, nparams, shape, cuda):
    """Packed vs padded micro-batches on one batch with an RL length mix (see the module docstring)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.data.batch import TokenBatch
    from megarl.data.packing import pack_bins, split_by_token_budget
    from megarl.models.fusions import fusions_enabled
    from megarl.workers.batch import micro_inputs
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    n = a.samples or (64 if cuda else 32)
    prompt = a.prompt_len or (256 if cuda else 16)
    mean = a.mean_response or (1024 if cuda else 64)
    longest = a.max_response or (8192 if cuda else 512)
    budget = a.tokens_per_mb or (16384 if cuda else 1024)
    pairs = rl_lengths(n, prompt, mean, longest)
    g = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    prompts = [torch.randint(0, V, (p,), generator=g).tolist() for p, _ in pairs]
    responses = [torch.randint(0, V, (r,), generator=g).tolist() for _, r in pairs]
    batch = TokenBatch.from_sequences(prompts, responses)
    lengths = batch.seq_lens.tolist()
    real_tokens = sum(lengths)
    flops = sum(model_flops_per_token(cfg, L) * L for L in lengths)
    n_resp = float(batch.response_lens.sum())
    fb = get_forward_backward_func()
    results = {}
    for mode in ("packed", "padded"):
        groups = pack_bins(lengths, budget) if mode == "packed" else split_by_token_budget(lengths, budget)
        micro = [micro_inputs(batch.select(gr), mode == "packed").to(device) for gr in groups]
        computed = sum(mi.input_ids.numel() for mi in micro)

        def step_fn(it, m):
            mi = next(it)
            out = m(mi.input_ids, mi.position_ids, None, packed_seq_params=mi.packed)

            def loss_fn(o, _mi=mi):
                lp, ent = logprobs_and_entropy(o.reshape(-1, o.shape[-1]), _mi.next_ids, V, with_entropy=True)
                keep = _mi.mask.bool()
                loss = -(lp[_mi.pred_index][keep]).sum() / n_resp * len(micro)
                return loss, {"loss": loss.detach()}
            return out, loss_fn

        def train_step():
            ddp.zero_grad_buffer()
            opt.zero_grad()
            fb(forward_step_func=step_fn, data_iterator=iter(micro), model=ddp, num_microbatches=len(micro),
               seq_length=max(mi.input_ids.shape[1] for mi in micro), micro_batch_size=1, forward_only=False)
            opt.step()

        st, times = timed_steps(train_step, a.warmup, a.steps, device)
        res = {"bench": "train_real_lengths", "mode": mode, "shape": shape, "params": nparams,
               "dtype": str(dtype).replace("torch.", ""), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "samples": n, "prompt_len": prompt, "mean_response": mean, "max_response": longest,
               "real_tokens": real_tokens, "computed_tokens": computed,
               "padding_frac": round(1 - real_tokens / computed, 4), "tokens_per_mb": budget,
               "micro_batches": len(micro), "step_s_median": st, "step_s_all": [round(x, 4) for x in times],
               "useful_tokens_per_s": real_tokens / st, "useful_model_tflops_per_s": flops / st / 1e12,
               "matmul_peak_tflops": peak / 1e12, "useful_mfu_vs_measured_peak": flops / st / peak,
               "fusions": fusions_enabled()}
        if cuda:
            res["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
            from megarl.models.packed_attention import packed_attention_backend
            res["packed_attention"] = packed_attention_backend(torch.empty(0, device=device, dtype=dtype))
        results[mode] = res
        print(json.dumps(res), flush=True)
    ratio = results["packed"]["useful_tokens_per_s"] / results["padded"]["useful_tokens_per_s"]
    print(json.dumps({"bench": "train_real_lengths_ratio", "shape": shape, "packed_vs_padded_tokens_per_s": ratio,
                      "packed_useful_mfu": results["packed"]["useful_mfu_vs_measured_peak"],
                      "padded_useful_mfu": results["padded"]["useful_mfu_vs_measured_peak"]}), flush=True)


if __name__ == "__main__":
    main()
