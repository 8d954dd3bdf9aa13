"""Embedded engine decode tokens/s vs HF `generate` on the same model and batch (one JSON line).

    python benchmarks/bench_rollout.py [--batch 8] [--new 64] [--model DIR | --smollm2]
    python benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 1,32,128 --parity
    python benchmarks/bench_rollout.py --device cuda --shape qwen2.5-0.5b --batch 128 --temperature 1 --no-hf
Default model: a random llama (hidden 256, 4 layers, vocab 4096), fp32 on CPU.  ``--shape`` builds a
random-init HF model of that shape (bf16 on GPU) in a temp dir.  On GPU each line also reports the
memory-bandwidth bound: (weight bytes + mean KV bytes read per step) / measured copy bandwidth.
``--parity``: sample with the engine (temperature 1), then score the same tokens with HF
transformers and with megarl's megatron model (build_model + load_hf_weights, bf16): mean/max
|logprob diff| of each pair, one more JSON line.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="8", help="one size, or a comma list (GPU mode)")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--smollm2", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="random-init HF model shape, e.g. qwen2.5-0.5b")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="GPU: also decode with the block-FP8 copy of the model "
                    "(megarl convert hf-to-fp8), same batches, same run")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", default=None, help="GPU: write a torch.profiler table of one engine run per "
                                                     "batch (the last decode step mode) to this file")
    ap.add_argument("--kernels", default="auto",
                    help="decode step(s) to time, comma list of auto (triton on CUDA, torch on CPU) | triton (fused) | "
                         "triton-proj (fused, projections in Triton too) | "
                         "torch (the reference body); a +sync suffix turns off launching step t+1 before step t is "
                         "read; +fallback decodes, then samples (the served engine's path before it got decode_launch, and at TP > 1); "
                         "+splitN: N keys per attention split (default kernels.SPLIT_KEYS); +blkN / +warpsN / +stagesN: "
                         "the attention kernel's keys per block, warps and pipeline stages; +rope / +norope: RoPE and "
                         "the cache write inside the attention kernel / in their own kernel (unnamed: the default); "
                         "+torchprefill: admissions prefill with the torch body (MEGARL_PREFILL_KERNELS=torch) instead "
                         "of the decode step's kernels; +pgraph / +pgraphN: prefills replayed from CUDA graphs up to "
                         "the default's / N tokens (MEGARL_PREFILL_GRAPH_TOKENS=auto / N; +pgraph0: every prefill "
                         "launched eagerly); the first is the baseline of the ratio")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="GPU mode: 0 = greedy (the bandwidth-bound row); 1 = seeded sampling as in the RL loop")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="GPU mode: nucleus filter on every request (< 1: the graph's sampler sorts each row)")
    a = ap.parse_args()
    if a.device != "cpu" or "," in str(a.batch) or a.shape:
        return main_gpu(a)
    a.batch = int(a.batch)
    torch.set_num_threads(a.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.engine.engine import Engine, Request, Sampling
    from megarl.engine.model import DecoderModel
    from megarl.engine.worker import one_rank_handle
    from tests.helpers.servers import make_tiny_hf_model
    d = a.model
    if a.smollm2:
        from megarl.checkpoint.smollm2 import smollm2_hf_dir
        d = str(smollm2_hf_dir())
    if d is None:
        d = tempfile.mkdtemp()
        make_tiny_hf_model(d, "llama", vocab_size=4096, hidden_size=256, intermediate_size=768,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, std=0.05)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, hf.config.vocab_size, (a.batch, a.prompt), generator=g)

    def run_hf():
        t = time.perf_counter()
        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=a.new,
                          min_new_tokens=a.new, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t, out.shape[1] - a.prompt

    model = DecoderModel(AutoConfig.from_pretrained(d))
    model.load_hf_dir(d)
    eng = Engine(one_rank_handle(model), max_running=a.batch, max_len=a.prompt + a.new + 1)
    eng.start()

    def run_engine():
        t = time.perf_counter()
        futs = eng.submit_many([Request(p.tolist(), Sampling(max_new_tokens=a.new, temperature=0.0, ignore_eos=True))
                                for p in prompts])
        outs = [f.result() for f in futs]
        return time.perf_counter() - t, len(outs[0]["output_ids"])

    run_hf(), run_engine()  # warm-up
    th, nh = min(run_hf() for _ in range(2))
    te, ne = min(run_engine() for _ in range(2))
    eng.stop()
    res = {"bench": "rollout_decode", "model": os.path.basename(d.rstrip("/")) if a.model or a.smollm2 else "llama-h256-l4-v4096",
           "batch": a.batch, "prompt_len": a.prompt, "new_tokens": a.new, "threads": a.threads, "device": "cpu",
           "embedded_tokens_per_s": a.batch * ne / te, "hf_generate_tokens_per_s": a.batch * nh / th,
           "ratio_embedded_over_hf": (a.batch * ne / te) / (a.batch * nh / th)}
    print(json.dumps(res))


def _fp8_model(d: str, device: str, dtype):
    """The embedded engine serving the block-FP8 copy of HF folder ``d``."""
    from transformers import AutoConfig

    from megarl.checkpoint.fp8_convert import convert_hf_to_fp8
    from megarl.engine.model import DecoderModel
    out = tempfile.mkdtemp(prefix="bench_rollout_fp8_")
    convert_hf_to_fp8(d, out, verbose=False)
    model = DecoderModel(AutoConfig.from_pretrained(out), device=device, dtype=dtype)
    model.load_hf_dir(out)
    return model


def _random_hf_dir(shape: str, dtype) -> str:
    from transformers import AutoModelForCausalLM
    from bench_train import hf_config  # same shapes as the train benchmark
    cfg = hf_config(shape)
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    d = tempfile.mkdtemp(prefix="bench_rollout_")
    m.save_pretrained(d)
    return d


def _set_env(name: str, value: Optional[str]) -> None:
    """``os.environ[name] = value``; None: unset."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev, nbytes=2 << 30) -> float:
    """bytes read + written per second of a large device-to-device copy"""
    if dev.type != "cuda":
        nbytes = 64 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync(dev)
    return 2 * nbytes * 10 / (time.perf_counter() - t)


ATTENTION_SWITCHES = {"rope": "ROPE_IN_ATTENTION"}
ATTENTION_NUMBERS = {"split": "SPLIT_KEYS", "blk": "ATTN_BLOCK_KEYS", "warps": "ATTN_WARPS", "stages": "ATTN_STAGES"}


def _attention_split(kernels, suffixes, defaults: dict) -> None:
    """Apply a mode's attention suffixes to the Triton step: +splitN, +blkN, +warpsN, +stagesN (each
    of ATTENTION_NUMBERS), and +NAME / +noNAME for each
    of ATTENTION_SWITCHES; a switch a mode does not name keeps the module's default (``defaults``:
    the values as imported), so a plain "triton" times what runs."""
    for prefix, name in ATTENTION_NUMBERS.items():
        setattr(kernels, name, next((int(x[len(prefix):]) for x in suffixes
                                     if x.startswith(prefix) and x[len(prefix):].isdigit()), defaults[name]))
    for name, switch in ATTENTION_SWITCHES.items():
        on = name in suffixes or defaults[switch] and f"no{name}" not in suffixes
        setattr(kernels, switch, on)


class _WithoutLaunch:
    """The served handle without ``decode_launch``: the engine decodes, then samples (a host read per
    step, the eager sampler) -- the served engine's path before its handle got ``decode_launch``, and the TP > 1 path."""

    def __init__(self, handle):
        self._handle = handle

    def __getattr__(self, name):
        if name == "decode_launch":
            raise AttributeError(name)
        return getattr(self._handle, name)


def main_gpu(a):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.engine.engine import Engine, Request, Sampling
    from megarl.engine.model import DecoderModel
    from megarl.engine.worker import one_rank_handle
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        torch.set_num_threads(a.threads)
    d = a.model or _random_hf_dir(a.shape or "tiny", dtype)
    name = a.shape or os.path.basename(d.rstrip("/"))
    hf = None if a.no_hf else AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
    model = DecoderModel(AutoConfig.from_pretrained(d), device=a.device, dtype=dtype)
    model.load_hf_dir(d)
    bw = copy_bandwidth(dev)
    wbytes = sum(t.numel() * t.element_size() for t in model.params.values())
    s = model.spec
    batches = [int(b) for b in str(a.batch).split(",")]
    model8 = _fp8_model(d, a.device, dtype) if a.fp8 else None
    g = torch.Generator().manual_seed(0)
    V = s.vocab_size
    for B in batches:
        prompts = torch.randint(0, V, (B, a.prompt), generator=g)
        handle = one_rank_handle(model)
        # as `megarl serve` runs it, but every prompt admitted in one prefill: the timed decode steps are
        # full-batch steps, not interleaved with admission waves (long prompts came in ~4 per wave)
        eng = Engine(handle, max_running=B, max_len=a.prompt + a.new + 1, max_prefill_tokens=max(8192, B * a.prompt))
        eng.start()

        def run_engine(new=a.new):
            _sync(dev)
            t = time.perf_counter()
            futs = eng.submit_many([Request(p.tolist(), Sampling(max_new_tokens=new, temperature=a.temperature,
                                                                 top_p=a.top_p, sampling_seed=i, ignore_eos=True))
                                    for i, p in enumerate(prompts)])
            outs = [f.result() for f in futs]
            run_engine.outputs = [o["output_ids"] for o in outs]
            return time.perf_counter() - t, sum(len(o["output_ids"]) for o in outs)

        def run_eager():
            model.use_cuda_graphs = False
            try:
                return run_engine()
            finally:
                model.use_cuda_graphs = dev.type == "cuda"

        per_mode, outputs, decode_only, admit_s = {}, {}, {}, {}
        from megarl.engine import kernels as triton_kernels
        defaults = {k: getattr(triton_kernels, k) for k in (*ATTENTION_NUMBERS.values(), *ATTENTION_SWITCHES.values())}
        prefill_env = os.environ.get("MEGARL_PREFILL_KERNELS")
        graph_env = os.environ.get("MEGARL_PREFILL_GRAPH_TOKENS")
        for mode in a.kernels.split(","):   # each decode step in its own graphs; the last one stays
            kern_mode, *suffixes = mode.split("+")   # "triton+sync": no step launched ahead
            model.decode_kernels, model._fused_views, model.graphs = kern_mode, None, None
            model.decode_overlap = "sync" not in suffixes
            _attention_split(triton_kernels, suffixes, defaults)
            eng.model = _WithoutLaunch(handle) if "fallback" in suffixes else handle   # (the engine is idle here)
            os.environ["MEGARL_PREFILL_KERNELS"] = "torch" if "torchprefill" in suffixes else "auto"
            model.prefill_graphs = None   # (made again with this mode's token limit)
            # +pgraph: "auto"; +pgraphN: N tokens in up to N rows
            pgraph = [x[len("pgraph"):] or "auto" for x in suffixes if x.startswith("pgraph")]
            _set_env("MEGARL_PREFILL_GRAPH_TOKENS", pgraph[0] if pgraph else graph_env)
            run_engine()
            # the admission alone: every request ends at its prefill's token (one prefill of B x prompt)
            admit_s[mode] = min(run_engine(new=1)[0] for _ in range(3))
            th_, _ = min(run_engine(new=a.new // 2) for _ in range(2))
            te, ne = min(run_engine() for _ in range(2))
            per_mode[mode], outputs[mode] = ne / te, run_engine.outputs
            # the decode steps alone: the same requests with half the new tokens are admitted (and
            # prefilled, between decode steps) the same way, so the difference is new/2 steps of the
            # full batch -- long prompts' prefill does not hide the decode step's own speed
            # (None where the two runs' noise swallowed the difference)
            decode_only[mode] = B * (a.new - a.new // 2) / (te - th_) if te > th_ else None
        # (the eager, FP8 and parity runs: the caller's prefill settings)
        _set_env("MEGARL_PREFILL_GRAPH_TOKENS", graph_env)
        _set_env("MEGARL_PREFILL_KERNELS", prefill_env)
        modes = list(per_mode)
        kern = {f"{m}_kernels_tokens_per_s": v for m, v in per_mode.items()}
        kern.update({f"{m}_decode_only_tokens_per_s": v for m, v in decode_only.items()})
        kern.update({f"{m}_admit_one_token_s": v for m, v in admit_s.items()})
        if len(modes) > 1:
            same = [x == y for x, y in zip(outputs[modes[0]], outputs[modes[-1]])]
            kern.update({f"ratio_{modes[-1]}_over_{modes[0]}": per_mode[modes[-1]] / per_mode[modes[0]],
                         "greedy_sequences_identical_across_kernels": sum(same) / len(same)})
        if a.profile:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                tp_, np_ = run_engine()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_admit:
                ta_, na_ = run_engine(new=1)   # the admission alone: its kernels' time vs its wall
            with open(a.profile, "a") as f:
                f.write(f"== batch {B}, kernels {modes[-1]}: {np_} tokens in {tp_:.3f} s\n")
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25) + "\n")
                f.write(f"== batch {B}, kernels {modes[-1]}, admission only: {na_} tokens in {ta_:.4f} s\n")
                f.write(prof_admit.key_averages().table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
        run_eager()
        tx, nx = min(run_eager() for _ in range(2))
        eng.stop()
        fp8 = {}
        if model8 is not None:
            eng8 = Engine(one_rank_handle(model8), max_running=B, max_len=a.prompt + a.new + 1)
            eng8.start()
            eng, saved = eng8, eng
            run_engine()
            t8, n8 = min(run_engine() for _ in range(2))
            eng8.stop()
            eng = saved
            fp8 = {"fp8_embedded_tokens_per_s": n8 / t8, "ratio_fp8_over_bf16": (n8 / t8) / (ne / te),
                   "fp8_note": "the engine computes with a dequantized bf16 copy of the FP8 weights"}
        res = {"bench": "rollout_decode", "model": name + " (random init)", "dtype": str(dtype).replace("torch.", ""),
               "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
               "batch": B, "prompt_len": a.prompt, "new_tokens": a.new, "temperature": a.temperature,
               "top_p": a.top_p, "embedded_tokens_per_s": ne / te, "embedded_eager_tokens_per_s": nx / tx,
               "ratio_graphs_over_eager": (ne / te) / (nx / tx),
               "graph_captures": model.graphs.captures if model.graphs is not None else 0,
               "decode_kernels": modes[-1], **kern, **fp8}
        if hf is not None:
            pi = prompts.to(dev)

            def run_hf():
                _sync(dev)
                t = time.perf_counter()
                with torch.inference_mode():
                    out = hf.generate(pi, attention_mask=torch.ones_like(pi), max_new_tokens=a.new,
                                      min_new_tokens=a.new, do_sample=False, pad_token_id=0)
                _sync(dev)
                run_hf.outputs = out[:, a.prompt:].tolist()
                return time.perf_counter() - t, (out.shape[1] - a.prompt) * B
            run_hf()
            th, nh = min(run_hf() for _ in range(2))
            res.update(hf_generate_tokens_per_s=nh / th, ratio_embedded_over_hf=(ne / te) / (nh / th))
            if a.temperature == 0:   # greedy: how far each decode step follows HF's tokens (bf16 drifts)
                for mode, outs in outputs.items():
                    prefix = [next((j for j, (x, y) in enumerate(zip(o, h)) if x != y), len(o))
                              for o, h in zip(outs, run_hf.outputs)]
                    res[f"{mode}_greedy_identical_to_hf"] = sum(p == a.new for p in prefix) / len(prefix)
                    res[f"{mode}_greedy_mean_prefix_equal_to_hf"] = sum(prefix) / len(prefix)
        # bandwidth bound of one decode step: every weight once + the KV of the mean context (of all
        # the new tokens; of the second half for the decode-only rate)
        def bound_at(ctx: float) -> Tuple[float, float]:
            kv = B * s.num_layers * 2 * s.num_kv_heads * s.head_dim * ctx * torch.finfo(dtype).bits // 8
            return kv, B * bw / (wbytes + kv)
        kv, bound = bound_at(a.prompt + a.new / 2)
        _, bound_late = bound_at(a.prompt + (a.new // 2 + a.new) / 2)
        res.update(weight_bytes=wbytes, kv_bytes_per_step=int(kv), copy_bw_bytes_per_s=bw,
                   bw_bound_tokens_per_s=bound, fraction_of_bw_bound=(ne / te) / bound,
                   decode_only_tokens_per_s=decode_only[modes[-1]],
                   decode_only_fraction_of_bw_bound=(decode_only[modes[-1]] / bound_late
                                                     if decode_only[modes[-1]] is not None else None))
        print(json.dumps(res), flush=True)
    if a.parity:
        parity(a, d, dev, dtype, model, hf, name)


def parity(a, d, dev, dtype, model, hf, name):
    """engine-sampled tokens -> logprobs from engine / HF / megatron, mean |diff|."""
    from megarl.engine.engine import Engine, Request, Sampling
    B, P, N = 8, 64, 128
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.spec.vocab_size, (B, P), generator=g)
    eng = Engine(model, max_running=B, max_len=P + N + 1)
    eng.start()
    futs = [eng.submit(Request(p.tolist(), Sampling(max_new_tokens=N, temperature=1.0, ignore_eos=True),
                               return_logprob=True)) for p in prompts]
    outs = [f.result() for f in futs]
    eng.stop()
    seqs = torch.stack([torch.cat([p, torch.tensor(o["output_ids"])]) for p, o in zip(prompts, outs)]).to(dev)
    eng_lp = torch.tensor([[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs], dtype=torch.float32)
    tgt = seqs[:, P:]

    def score(logits):
        return torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, tgt[..., None])[..., 0].cpu()
    res = {"bench": "logprob_parity", "model": name + " (random init)", "dtype": str(dtype).replace("torch.", ""),
           "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "sequences": B,
           "prompt_len": P, "response_len": N, "mean_abs_engine_logprob": eng_lp.abs().mean().item()}
    if hf is not None:
        with torch.inference_mode():
            hf_lp = score(hf(seqs).logits)
        res.update(hf_vs_engine_mean=(hf_lp - eng_lp).abs().mean().item(),
                   hf_vs_engine_max=(hf_lp - eng_lp).abs().max().item())
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    from megarl.parallel import free_port, init_distributed, init_model_parallel
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed()
    init_model_parallel(tp=1, pp=1)
    from megarl.models import build_model, forward_logits, load_hf_weights
    chunks = [c.to(dev) for c in build_model(d, params_dtype=dtype)]
    load_hf_weights(chunks, d)
    with torch.no_grad():
        mg_lp = score(forward_logits(chunks, seqs))
    res.update(megatron_vs_engine_mean=(mg_lp - eng_lp).abs().mean().item(),
               megatron_vs_engine_max=(mg_lp - eng_lp).abs().max().item())
    if hf is not None:
        res.update(megatron_vs_hf_mean=(mg_lp - hf_lp).abs().mean().item(),
                   megatron_vs_hf_max=(mg_lp - hf_lp).abs().max().item())
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
