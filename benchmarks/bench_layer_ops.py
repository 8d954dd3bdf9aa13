"""Ops a packed actor micro-batch dispatches, forward-only and forward + backward, with all of
megarl's launch savings against baselines in the same run (one JSON line):

* ``megarl``: RoPE rows gathered once per micro-batch (megarl/models/packed.py) and weight
  gradients accumulated straight into DDP's main_grad (megarl/parallel/wgrad_accumulation.py);
* ``rope_per_call``: the rows gathered again for q and k of every layer (megarl before);
* ``wgrad_unfused``: megatron's unfused weight gradients (GEMM into param.grad, the DDP hook adds);
* ``megatron``: megatron-core's own THD RoPE (split per sequence, host reads) and unfused gradients.

Why count ops: on the GPU the one-GPU GRPO step's train phase is bound by the host launching
~2 300 kernels per micro-batch (benchmarks/RESULTS.md, train phase host cost), so every op dispatched per layer
costs host time whatever its size. Ops are counted at the dispatcher (megarl.profiling.OpCounter)
with views and allocations left out, so the count is the same on any machine and close to the
kernel launches on CUDA (one eager compute op is about one kernel; the compiled fusions, which the
counter cannot see into, are off in this benchmark). On CUDA the passes are also timed without the
counter (median wall seconds; at ``--shape host-smollm2`` that is host time). The model is wrapped
in megatron's DDP with fp32 gradient buffers, as the actor is.

    python benchmarks/bench_layer_ops.py                         # CPU, host-smollm2, 8 sequences
    python benchmarks/bench_layer_ops.py --device cuda --repeats 20
    python benchmarks/bench_layer_ops.py --device cuda --repeats 20 --fusions   # kernels, as the actor runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

def lengths(n: int, mean: int, seed: int = 0) -> list[int]:
    """``n`` sequence lengths between mean/2 and 3 mean/2 (packed micro-batch of an RL batch)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(max(1, mean // 2), mean + mean // 2 + 1, (n,), generator=g)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="host-smollm2", help="a shape of bench_train.py")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--sequences", type=int, default=8, help="sequences packed into the micro-batch")
    ap.add_argument("--mean-len", type=int, default=48, help="mean tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per variant (CUDA)")
    ap.add_argument("--fusions", action="store_true",
                    help="CUDA: with the compiled RMSNorm/RoPE/SwiGLU the actor uses; counts the kernels "
                         "torch.profiler sees instead of dispatched ops (compiled regions hide theirs)")
    ap.add_argument("--by-op", type=int, default=0, metavar="N",
                    help="also list megarl's N most dispatched ops of a forward + backward pass, per layer")
    a = ap.parse_args()
    os.environ["MEGARL_FUSIONS"] = "1" if a.fusions else "0"
    import bench_train
    cuda = bench_train.use_cuda(a.device)
    if a.fusions and not cuda:
        raise SystemExit("--fusions: needs a CUDA device (on CPU the fusions are off)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(2)

    bench_train.init_one_rank(cuda)
    from megatron.core.models.common.embeddings import rope_utils

    from megarl.models import build_model
    from megarl.models import packed as packed_mod
    from megarl.profiling import OpCounter
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megarl.parallel.wgrad_accumulation import install_wgrad_accumulation

    cfg = bench_train.hf_config(a.shape)
    model = build_model(cfg, params_dtype=dtype)[0].to(device)   # installs megarl's THD RoPE
    model.config.variable_seq_lengths = True
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    install_wgrad_accumulation([ddp])
    fused = [m for m in ddp.modules() if getattr(m, "gradient_accumulation_fusion", False)]
    ddp.train()
    layers = len(model.decoder.layers)
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths(a.sequences, a.mean_len)]

    def per_call(t, cu_seqlens, freqs, **kw):
        """megarl's THD RoPE gathering the rows again for every call (before they were kept)."""
        packed_mod.drop_kept_rows()
        return packed_mod.apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, **kw)

    # variant: (THD RoPE, weight gradients into main_grad)
    variants = {"megarl": (packed_mod.apply_rotary_pos_emb_thd, True),
                "rope_per_call": (per_call, True),
                "wgrad_unfused": (packed_mod.apply_rotary_pos_emb_thd, False),
                "megatron": (packed_mod._ORIGINAL_THD, False)}

    def one_pass(backward: bool) -> None:
        # a fresh micro-batch each pass, as each micro-batch of a step is
        ids, pos, params = packed_mod.pack_sequences(seqs, device)
        ddp.zero_grad_buffer()
        with torch.set_grad_enabled(backward):
            out = ddp(ids, pos, None, packed_seq_params=params)
            if backward:
                lp, _ = logprobs_and_entropy(out.reshape(-1, out.shape[-1])[:-1], ids[0, 1:], V)
                (-lp.mean()).backward()

    def kernels(backward: bool) -> int:
        """Kernels (and device memsets/copies) of one pass, as torch.profiler records them."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            one_pass(backward)
            bench_train.sync(device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    unit = "kernels" if a.fusions else "ops"
    res = {"bench": "layer_ops", "shape": a.shape, "fusions": a.fusions, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
           "dtype": str(dtype).replace("torch.", ""), "layers": layers, "sequences": a.sequences,
           "tokens": sum(len(s) for s in seqs), "wgrad_fused_layers": len(fused)}
    try:
        for name, (fn, wgrad_fused) in variants.items():
            rope_utils._apply_rotary_pos_emb_thd = fn
            for m in fused:
                m.gradient_accumulation_fusion = wgrad_fused
            for backward in (False, True):
                for _ in range(2):  # warm-up (lazy allocations, caches, compiled regions)
                    one_pass(backward)
                tag = f"{name}_{'fwd_bwd' if backward else 'fwd'}"
                if a.fusions:
                    count = kernels(backward)
                else:
                    counter = OpCounter()
                    with counter:
                        one_pass(backward)
                    count = counter.total
                    res[f"{tag}_host_reads"] = counter.host_reads
                    if a.by_op and tag == "megarl_fwd_bwd":
                        res["megarl_fwd_bwd_ops_per_layer_by_name"] = {
                            k: round(v / layers, 2) for k, v in counter.ops.most_common(a.by_op)}
                res[f"{tag}_{unit}"] = count
                res[f"{tag}_{unit}_per_layer"] = round(count / layers, 1)
                if cuda:   # warmed up above
                    res[f"{tag}_s_median"], _ = bench_train.timed_steps(lambda: one_pass(backward), 0, a.repeats,
                                                                         device)
    finally:
        rope_utils._apply_rotary_pos_emb_thd = variants["megarl"][0]
    for p in ("fwd", "fwd_bwd"):
        for base in ("rope_per_call", "wgrad_unfused", "megatron"):
            res[f"{p}_{unit}_ratio_vs_{base}"] = round(res[f"megarl_{p}_{unit}"] / res[f"{base}_{p}_{unit}"], 3)
            if cuda:
                res[f"{p}_time_ratio_vs_{base}"] = round(res[f"megarl_{p}_s_median"] / res[f"{base}_{p}_s_median"], 3)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
