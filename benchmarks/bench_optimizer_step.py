"""megatron-core's optimizer step without Transformer Engine / Apex: its own Python-loop fallbacks
(per-tensor L2 norm read to the host, per-tensor scale and copy) against megarl's foreach kernels
(megarl/parallel/optimizer_kernels.py), on the same model and optimizer, alternating step by step.

What MegatronWorker builds with one data-parallel rank: bf16 params, fp32 main params, torch AdamW,
gradient clipping (clip_grad 1.0, with gradients large enough that it scales every step), then the
main params copied into the model params. Gradients are fixed random values written into the DDP
grad buffer (the forward/backward is not what is measured).

Prints one JSON line: median seconds of ``optimizer.step()`` per variant, their ratio, and the host
reads (``aten::_local_scalar_dense``) per step outside torch's AdamW.

    python benchmarks/bench_optimizer_step.py                       # CPU, SmolLM2-135M shape
    python benchmarks/bench_optimizer_step.py --device cuda --shape qwen2.5-0.5b
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_train import SHAPES as TRAIN_SHAPES, init_one_rank, sync, use_cuda  # noqa: E402

SHAPES = dict(TRAIN_SHAPES, **{
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the default recipe's model)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
})


@contextlib.contextmanager
def megatron_bindings(ours: bool, theirs_copy):
    """Bind megarl's foreach kernels (``ours``) or megatron's own loops into megatron's modules."""
    from megatron.core import utils as mcore_utils
    from megatron.core.optimizer import clip_grads, optimizer as mcore_optimizer

    from megarl.parallel import optimizer_kernels as k

    chosen = {(clip_grads, "l2_norm_impl"): k.foreach_l2_norm if ours else mcore_utils.local_multi_tensor_l2_norm,
              (clip_grads, "multi_tensor_scale_impl"): k.foreach_scale if ours else mcore_utils.local_multi_tensor_scale,
              (mcore_optimizer, "multi_tensor_scale_impl"): k.foreach_scale if ours else mcore_utils.local_multi_tensor_scale,
              (mcore_optimizer, "_multi_tensor_copy_this_to_that"): k.foreach_copy_this_to_that if ours else theirs_copy}
    before = {key: getattr(*key) for key in chosen}
    for (module, name), fn in chosen.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for (module, name), fn in before.items():
            setattr(module, name, fn)


def host_reads_outside_adam(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    from megarl.profiling import host_reads

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return host_reads(prof)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (alternating)")
    a = ap.parse_args()
    cuda = use_cuda(a.device)
    if not cuda:
        torch.set_num_threads(2)
    device = torch.device(a.device)
    init_one_rank(cuda)

    from transformers import LlamaConfig
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from megarl.models import build_model

    theirs_copy = mcore_optimizer._multi_tensor_copy_this_to_that
    cfg = LlamaConfig(max_position_embeddings=4096, rms_norm_eps=1e-5, **SHAPES[a.shape])
    model = build_model(cfg, params_dtype=torch.bfloat16, bf16=True)[0].to(device)
    ddp = DistributedDataParallel(config=model.config, module=model,
                                  ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                           overlap_grad_reduce=False))
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-6, weight_decay=0.01, clip_grad=1.0,
                                                 bf16=True, params_dtype=torch.bfloat16), [ddp])
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g).to(device) for p in params]

    def step() -> float:
        ddp.zero_grad_buffer()
        opt.zero_grad()
        for p, gr in zip(params, grads):
            p.main_grad.copy_(gr)
        ok, norm, _ = opt.step()
        return norm

    times: dict[str, list[float]] = {"megatron_loops": [], "foreach": []}
    reads, norms = {}, {}
    for variant in times:                       # warm-up: the AdamW state and the kernels
        with megatron_bindings(variant == "foreach", theirs_copy):
            norms[variant] = step()
            reads[variant] = host_reads_outside_adam(step)
    for i in range(a.steps):
        for variant in (list(times) if i % 2 == 0 else list(times)[::-1]):
            with megatron_bindings(variant == "foreach", theirs_copy):
                sync(device)
                t = time.perf_counter()
                step()
                sync(device)
                times[variant].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "optimizer_step", "shape": a.shape, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "param_tensors": len(params), "params": sum(p.numel() for p in params),
        "step_s_median": {k: round(v, 5) for k, v in med.items()},
        "speedup_foreach_vs_megatron_loops": round(med["megatron_loops"] / med["foreach"], 3),
        "host_reads_per_step": reads,
        "grad_norm_rel_diff": abs(norms["foreach"] - norms["megatron_loops"]) / norms["megatron_loops"],
        "steps_per_variant": a.steps}), flush=True)


if __name__ == "__main__":
    main()
