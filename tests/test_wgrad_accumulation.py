"""Weight gradients accumulated into megatron's main_grad without Apex
(megarl/parallel/wgrad_accumulation.py): the same main_grad as megatron's own unfused path (GEMM into
param.grad, DDP hook adds it) on the same weights and micro-batches, at TP1 and TP2, for a model
with a tied output layer (qwen2) and one without (llama, whose output layer is switched too), and
for MoE experts at EP2 (qwen3_moe); one add fewer per switched layer and micro-batch; the fp32 LM
head in bf16 left unfused."""
from __future__ import annotations

import pytest
import torch

from dist_utils import make_tiny_hf

from megarl.parallel import spawn


def test_accumulate_wgrad_adds_the_weight_gradient_into_main_grad():
    from megarl.parallel.wgrad_accumulation import accumulate_wgrad

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 7, generator=g)
    dy = torch.randn(2, 5, 3, generator=g)
    main = torch.randn(3, 7, generator=g)
    want = main.double() + dy.reshape(-1, 3).double().t() @ x.reshape(-1, 7).double()
    accumulate_wgrad(x, dy, main)
    torch.testing.assert_close(main.double(), want, rtol=1e-6, atol=1e-6)
    # bf16 gradients into an fp32 main_grad (the GPU's case), whichever kernel the device offers
    main32 = torch.randn(3, 7, generator=g)
    want = main32.double() + dy.bfloat16().reshape(-1, 3).double().t() @ x.bfloat16().reshape(-1, 7).double()
    accumulate_wgrad(x.bfloat16(), dy.bfloat16(), main32)
    assert main32.dtype == torch.float32
    torch.testing.assert_close(main32.double(), want, rtol=2e-2, atol=2e-2)


def _main_grads(rank, world, hf_dir, seqs, tp, vocab, ep=1):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models import build_model, load_hf_weights
    from megarl.models.packed import pack_sequences
    from megarl.parallel import destroy_model_parallel, init_model_parallel
    from megarl.parallel.wgrad_accumulation import install_wgrad_accumulation
    from megarl.profiling import OpCounter
    from megarl.workers.vocab_parallel import logprobs_and_entropy

    init_model_parallel(tp=tp, ep=ep)
    model = build_model(hf_dir)[0]
    load_hf_weights([model], hf_dir)
    model.config.variable_seq_lengths = True
    ddp = DistributedDataParallel(config=model.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                  module=model)
    model.config.finalize_model_grads_func = finalize_model_grads
    model.config.no_sync_func = ddp.no_sync
    micro = [pack_sequences(seqs[:2]), pack_sequences(seqs[2:])]

    def step_fn(it, m):
        ids, pos, params = next(it)
        out = m(ids, pos, None, packed_seq_params=params)

        def loss_fn(o, _ids=ids):
            lp, _ = logprobs_and_entropy(o.reshape(-1, o.shape[-1])[:-1], _ids[0, 1:], vocab)
            loss = -lp.mean()
            return loss, {"loss": loss.detach()}
        return out, loss_fn

    def grads() -> tuple[dict, int]:
        ddp.zero_grad_buffer()
        counter = OpCounter()
        with counter:
            get_forward_backward_func()(forward_step_func=step_fn, data_iterator=iter(micro), model=ddp,
                                        num_microbatches=len(micro), seq_length=max(m[0].shape[1] for m in micro),
                                        micro_batch_size=1, forward_only=False)
        return ({n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters() if p.requires_grad},
                counter.ops["aten.add_"])

    ddp.train()
    theirs, adds_theirs = grads()
    switched = install_wgrad_accumulation([ddp])
    ours, adds_ours = grads()
    layers = len(model.decoder.layers)
    destroy_model_parallel()
    worst = max(((ours[n] - theirs[n]).abs().max() / theirs[n].abs().max().clamp(min=1e-12)).item() for n in theirs)
    return {"worst": worst, "switched": switched, "layers": layers, "adds": (adds_theirs, adds_ours),
            "zero": sorted(n for n, t in theirs.items() if not bool(t.abs().sum() > 0))}


@pytest.mark.parametrize("family,tp,ep", [("qwen2", 1, 1), ("llama", 2, 1), ("qwen3_moe", 1, 2)])
def test_fused_main_grads_equal_megatrons_unfused_path(family, tp, ep, tmp_path):
    hf = make_tiny_hf(family, tmp_path)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 12, 6)]
    for res in spawn(_main_grads, tp * ep, str(tmp_path), seqs, tp, hf.config.vocab_size, ep):
        assert not res["zero"], res
        assert res["worst"] < 1e-5, res
        tied = bool(hf.config.tie_word_embeddings)
        if ep == 1:   # qkv, proj, fc1, fc2 per layer; the output layer too when it owns its weight
            assert res["switched"] == 4 * res["layers"] + (0 if tied else 1), res
        else:         # qkv and proj per layer, fc1 and fc2 of each of this rank's experts, the output layer
            local = hf.config.num_experts // ep
            assert res["switched"] == (2 + 2 * local) * res["layers"] + 1, res
        # each switched layer: one main_grad add fewer per micro-batch that reaches it (two micro-batches)
        assert res["adds"][0] - res["adds"][1] <= 2 * res["switched"], res
        assert res["adds"][0] - res["adds"][1] >= 2 * (res["switched"] - (local * res["layers"] if ep > 1 else 0)), res


def _fp32_head_bf16(rank, world):
    """A bf16 output layer computed in fp32 (models/fp32_head.py: called with an fp32 copy of its
    weight, which has no main_grad) next to a bf16 hidden layer: the install leaves the head alone,
    and a backward accumulates both weights' gradients into their fp32 main_grad."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megarl.models.fp32_head import use_fp32_output_layer
    from megarl.parallel import destroy_model_parallel, init_model_parallel
    from megarl.parallel.wgrad_accumulation import install_wgrad_accumulation

    init_model_parallel(tp=1)
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, params_dtype=torch.bfloat16)
    model = torch.nn.Module()
    model.hidden = ColumnParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                        gather_output=False)
    model.output_layer = ColumnParallelLinear(8, 16, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                              gather_output=False)
    for p in model.parameters():   # what megatron's DDP gives every trainable weight
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    use_fp32_output_layer(model)
    switched = install_wgrad_accumulation([model])
    x = torch.randn(3, 1, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    h, _ = model.hidden(x)
    out, _ = model.output_layer(h)
    out.float().square().sum().backward()
    head = model.output_layer.weight
    result = {"switched": switched, "hidden_main_grad": float(model.hidden.weight.main_grad.abs().sum()),
              "head_grad": None if head.grad is None else float(head.grad.float().abs().sum())}
    destroy_model_parallel()
    return result


def test_fp32_head_is_left_unfused_and_bf16_gradients_reach_main_grad():
    res = spawn(_fp32_head_bf16, 1)[0]
    assert res["switched"] == 1                  # the hidden layer only
    assert res["hidden_main_grad"] > 0           # bf16 gradient accumulated into the fp32 main_grad
    assert res["head_grad"] is not None and res["head_grad"] > 0   # the head's own (unfused) gradient
