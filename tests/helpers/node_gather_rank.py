"""One actor rank of the one-gather-per-node test (tests/test_colocated_node_gather.py), run inside
a network-namespace node: megatron on gloo, a small model from an HF folder, then the whole model
by the everywhere gather and by the node gather (plain and in the served block-FP8 format).
Prints one JSON line: equality per form and the bytes this rank moved."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    hf_dir, tp, pp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from transformers import AutoConfig

    from megarl.models import build_model, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_distributed, init_model_parallel
    from megarl.quant.served import BlockFp8Format
    from megarl.sync.colocated import NodeShareStats, iter_hf_weights_by_node, iter_hf_weights_everywhere, node_layout
    from megarl.wire.process_group import bind_gloo_towards

    torch.set_num_threads(1)
    apply_cpu_shim()
    bind_gloo_towards(os.environ["MASTER_ADDR"])
    init_distributed("gloo", timeout_s=120)
    init_model_parallel(tp=tp, pp=pp)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    layout = node_layout(120)
    everywhere = [(n, t.clone()) for n, t in iter_hf_weights_everywhere(chunks)]
    stats = NodeShareStats()
    by_node = [(n, t.clone()) for n, t in iter_hf_weights_by_node(chunks, layout, stats=stats)]
    served = BlockFp8Format(quantized=frozenset(n for n, t in everywhere if t.dim() == 2 and "proj" in n))
    want_fp8 = [(n, t.clone()) for n, t in served.stream(iter(everywhere))]
    fp8_stats = NodeShareStats()
    got_fp8 = [(n, t.clone()) for n, t in iter_hf_weights_by_node(chunks, layout, convert=served.stream,
                                                                  stats=fp8_stats)]

    def same(a, b, ordered: bool = True) -> bool:
        """The same tensors, bit for bit (and in the same order unless ``ordered`` is False: the
        FP8 stream holds each stage's small tensors back to that stage's end, not the model's)."""
        if ordered and [n for n, _ in a] != [n for n, _ in b]:
            return False
        bs = dict(b)
        return len(a) == len(bs) and all(
            n in bs and x.dtype == bs[n].dtype and x.shape == bs[n].shape
            and torch.equal(x.reshape(-1).view(torch.uint8), bs[n].reshape(-1).view(torch.uint8)) for n, x in a)

    from megatron.core import parallel_state as mpu
    stage_bytes = sum(t.numel() * t.element_size() for _, t in everywhere)
    print(json.dumps({"rank": dist.get_rank(), "stage": mpu.get_pipeline_model_parallel_rank(),
                      "nodes": layout.nodes, "fits": layout.fits, "tensors": len(everywhere),
                      "model_bytes": stage_bytes, "plain_equal": same(everywhere, by_node),
                      "fp8_equal": same(want_fp8, got_fp8, ordered=False), "fp8_order": [n for n, _ in got_fp8],
                      "fp8_model_bytes": sum(t.numel() * t.element_size() for _, t in want_fp8),
                      "plain": stats.__dict__, "fp8": fp8_stats.__dict__}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
