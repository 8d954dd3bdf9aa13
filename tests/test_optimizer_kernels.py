"""megarl.parallel.optimizer_kernels against megatron-core's own fallbacks (megatron.core.utils
``local_multi_tensor_l2_norm`` / ``local_multi_tensor_scale``, ``_multi_tensor_copy_this_to_that``):
the same numbers, and a whole megatron bf16 optimizer step (norm, clipping, main -> model copy)
that ends on the same parameters with one host sync for the norm instead of one per tensor."""
import torch

from dist_utils import sample_ids

from megarl.parallel import spawn

# SmolLM2-like spread: small norms' vectors, wide matrices, one embedding
SHAPES = [(576,), (576, 576), (192, 576), (1536, 576), (576, 1536), (4096, 576), (7,)]


def _tensors(seed: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(10.0 ** (i % 3 - 1)).to(dtype) for i, s in enumerate(SHAPES)]


def test_l2_norm_equals_megatrons_fallback_and_float64():
    from megarl.parallel import apply_cpu_shim
    from megarl.parallel.optimizer_kernels import foreach_l2_norm
    from megatron.core.utils import local_multi_tensor_l2_norm

    apply_cpu_shim()   # megatron's fallback puts its result on device="cuda"
    flag = torch.zeros(1, dtype=torch.int)
    fp32 = _tensors(0)
    mixed = fp32 + _tensors(1, torch.bfloat16)
    # bounds: fp32 accumulation over 2.4M elements (CPU kernels differ in summation order)
    for grads in (fp32, mixed):
        ours, _ = foreach_l2_norm(2048 * 32, flag, [grads], False)
        exact = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
        assert ours.shape == (1,) and ours.dtype == torch.float32
        assert abs(ours.item() - exact) <= 5e-4 * exact
    # megatron's own fallback (megatron hands it fp32 main grads)
    ours, _ = foreach_l2_norm(2048 * 32, flag, [fp32], False)
    theirs, _ = local_multi_tensor_l2_norm(2048 * 32, flag, [fp32], False)
    assert abs(ours.item() - theirs.item()) <= 1e-4 * theirs.item()
    # a missing tensor would show: the largest one alone is not the total
    assert abs(foreach_l2_norm(0, flag, [fp32[:-2]], False)[0].item() - ours.item()) > 1e-3 * ours.item()
    empty, _ = foreach_l2_norm(2048 * 32, flag, [[]], False)
    assert empty.item() == 0.0


def test_scale_and_copy_equal_megatrons_loops_bit_for_bit():
    from megarl.parallel.optimizer_kernels import foreach_copy_this_to_that, foreach_scale
    from megatron.core.utils import local_multi_tensor_scale

    flag = torch.zeros(1, dtype=torch.int)
    # in place (gradient clipping: dst is src)
    ours, theirs = _tensors(2), _tensors(2)
    foreach_scale(0, flag, [ours, ours], 0.37)
    local_multi_tensor_scale(0, flag, [theirs, theirs], 0.37)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    # fp32 main params into bf16 model params, scaled and unscaled
    for scale in (1.0, 0.5):
        src = _tensors(3)
        ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        theirs = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
        foreach_scale(0, flag, [src, ours], scale)
        local_multi_tensor_scale(0, flag, [src, theirs], scale)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), scale
    src = _tensors(4) + _tensors(5, torch.bfloat16)
    ours = [torch.empty_like(t, dtype=torch.bfloat16) for t in src]
    foreach_copy_this_to_that(src, ours)
    assert all(torch.equal(o, s.to(torch.bfloat16)) for o, s in zip(ours, src))


def _optimizer_run(rank, world, hf_dir, ids, ours: bool):
    """Three bf16 steps of megatron's own optimizer on a tiny llama (clipping on every step);
    returns the final fp32 main params, the grad norms and the host syncs inside optimizer.step."""
    from torch.profiler import ProfilerActivity, profile

    from megarl.models import build_model, load_hf_weights
    from megarl.profiling import host_reads
    from megarl.parallel import init_model_parallel
    from megarl.parallel.optimizer_kernels import install_optimizer_kernels
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_model_parallel(tp=1)
    replaced = install_optimizer_kernels() if ours else []
    chunks = build_model(hf_dir, params_dtype=torch.bfloat16, bf16=True)
    load_hf_weights(chunks, hf_dir)
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    model = DistributedDataParallel(config=chunks[0].config, ddp_config=ddp, module=chunks[0])
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1e-3, bf16=True,
                                                 params_dtype=torch.bfloat16), [model])
    norms, syncs = [], []
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    for _ in range(3):
        model.zero_grad_buffer()
        opt.zero_grad()
        logits = model(ids, pos, None)
        logits.float().logsumexp(-1).mean().backward()
        model.finish_grad_sync()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ok, norm, _ = opt.step()
        assert ok
        norms.append(norm)
        syncs.append(host_reads(prof))   # torch's AdamW reads its CPU step counters: not counted
    main = [p.detach().clone() for g in opt.optimizer.param_groups for p in g["params"]]
    return {"replaced": replaced, "norms": norms, "syncs": syncs, "main": main}


def test_megatron_optimizer_step_with_foreach_kernels_matches_its_fallbacks(tmp_path):
    from dist_utils import make_tiny_hf

    make_tiny_hf("llama", tmp_path)
    ids = sample_ids(b=2, s=12)
    theirs = spawn(_optimizer_run, 1, str(tmp_path), ids, False)[0]
    ours = spawn(_optimizer_run, 1, str(tmp_path), ids, True)[0]
    assert set(ours["replaced"]) == {
        "megatron.core.optimizer.clip_grads.l2_norm_impl", "megatron.core.optimizer.clip_grads.multi_tensor_scale_impl",
        "megatron.core.optimizer.optimizer.multi_tensor_scale_impl",
        "megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that"}
    n_params = len(ours["main"])
    assert n_params >= 10
    # megatron's fallback reads every tensor's norm to the host; ours reads the total once
    assert min(theirs["syncs"]) >= n_params and max(ours["syncs"]) < n_params // 2, (theirs["syncs"], ours["syncs"])
    for a, b in zip(ours["norms"], theirs["norms"]):
        assert abs(a - b) <= 1e-5 * b
    # clipping was active (clip_grad 1e-3), so the norm fed every update; Adam's update is
    # sign-like, so a last-bit difference in the norm stays far below one lr-sized step
    assert all(n > 1e-3 for n in theirs["norms"])
    for a, b in zip(ours["main"], theirs["main"]):
        assert (a - b).abs().max().item() <= 1e-5
