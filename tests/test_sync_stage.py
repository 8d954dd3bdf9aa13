"""One update group per pipeline stage (megarl/sync/stage.py): the stage sender streams exactly what
the per-rank senders used to (the union of `iter_hf_weights` over TP0/DP0 and ETP0/EDP0 ranks),
experts of the other expert-parallel ranks included, every tensor once, in transfer units small
enough that the sender never holds more than one received unit; no other rank yields anything.
Layouts where a dense TP peer is also an expert-parallel peer (TP2 x EP2 on two ranks), with
expert TP (ETP2) and with two pipeline stages."""
from __future__ import annotations

import hashlib

import pytest
import torch

from tests.helpers.servers import make_tiny_hf_model

UNIT = 3000   # bytes: several transfer units per expert-parallel rank in the tiny model


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


LAYOUTS = {"tp2-ep2-dp2": (2, 1, 2, 1), "pp2-ep2": (1, 2, 2, 1), "tp2-ep2-etp2-dp2": (2, 1, 2, 2)}


def _all_layouts(rank, world, hf_dir, expert_senders=False):
    """One set of 4 processes for every layout (starting processes costs more than the layouts)."""
    return {name: _streams(rank, world, hf_dir, *layout, expert_senders) for name, layout in LAYOUTS.items()}


def _streams(rank, world, hf_dir, tp, pp, ep, etp, expert_senders=False):
    """What each rank streams at one layout, in the one-sender-per-stage shape or with every expert-
    parallel rank sending its own experts (``expert_senders``), and the union of the ranks' weights."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.push import is_sender_rank, sender_group_name
    from megarl.sync.stage import is_stage_sender, iter_stage_weights, stage_group_name, stage_index
    from megatron.core import parallel_state as mpu

    apply_cpu_shim()
    init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    g = torch.Generator().manual_seed(5)          # make every expert distinct from its file copy
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    old = {n: _digest(t) for n, t in iter_hf_weights(chunks, cfg)}      # the per-rank senders' union
    streamed = [(n, _digest(t)) for n, t in iter_stage_weights(chunks, bucket_bytes=4 * UNIT, unit_bytes=UNIT,
                                                                expert_senders=expert_senders)]
    union = [None] * world
    dist.all_gather_object(union, old)
    sender = is_sender_rank(expert_senders=True) if expert_senders else is_stage_sender()
    group = sender_group_name(expert_senders=True) if expert_senders else stage_group_name()
    return {"rank": rank, "sender": sender, "stage_sender": is_stage_sender(), "stage": stage_index(), "group": group,
            "ep_rank": mpu.get_expert_model_parallel_rank(), "streamed": streamed,
            "union": {k: v for part in union for k, v in part.items()}}


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    from megarl.parallel import spawn

    d = str(tmp_path_factory.mktemp("stage") / "moe")
    make_tiny_hf_model(d, "qwen3_moe", std=0.1, vocab_size=160, tie_word_embeddings=False)
    return spawn(_all_layouts, 4, d, timeout_s=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_sender_per_stage_streams_every_tensor_once(streams, layout):
    pp = LAYOUTS[layout][1]
    res = [r[layout] for r in streams]
    union = res[0]["union"]
    assert sum(".experts." in n for n in union) >= 8
    senders = [r for r in res if r["sender"]]
    assert sorted(r["stage"] for r in senders) == list(range(pp)), "exactly one sender per pipeline stage"
    assert sorted(r["group"] for r in senders) == [f"megarl_weights_pp{s}" for s in range(pp)]
    for r in res:
        if not r["sender"]:
            assert r["streamed"] == [], f"rank {r['rank']} is no sender but yielded tensors"
    names = [n for r in senders for n, _ in r["streamed"]]
    assert len(names) == len(set(names)), "a tensor was streamed twice"
    assert dict(n_d for r in senders for n_d in r["streamed"]) == union, "the stage streams = the old senders' union"
    for r in senders:   # every stage streams its own layers only, experts of all EP ranks included
        layers = {n.split(".")[2] for n, _ in r["streamed"] if n.startswith("model.layers.")}
        experts = {int(n.split(".")[5]) for n, _ in r["streamed"] if ".experts." in n}
        assert len(layers) == 2 // pp and experts == {0, 1, 2, 3}, (r["rank"], layers, experts)
