"""Expert senders (megarl/sync/stage.py, ``expert_senders=True``): every expert-parallel rank's
ETP0/EDP0 rank streams its own experts, the stage sender the dense weights and EP rank 0's experts;
together they stream exactly what one sender per stage streams, every tensor once, with no expert
transfer. A real push of that shape (two senders, two update groups) into an embedded server
leaves it computing the trainer's logprobs. (A TP1 server: two concurrent update groups into a TP2
embedded server fail the same way with one sender per stage at PP2.)"""
from __future__ import annotations

import asyncio

import pytest
import torch

from tests.helpers.servers import ServerProcess, make_tiny_hf_model
from tests.test_sync_stage import LAYOUTS, UNIT, _digest

PROMPT = [3, 14, 15, 92, 65, 35]


def _all_layouts(rank, world, hf_dir):
    return {name: _streams(rank, world, hf_dir, *layout) for name, layout in LAYOUTS.items()}


def _streams(rank, world, hf_dir, tp, pp, ep, etp):
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, iter_hf_weights, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.push import is_sender_rank, sender_group_name
    from megarl.sync.stage import iter_stage_weights

    apply_cpu_shim()
    init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    old = {n: _digest(t) for n, t in iter_hf_weights(chunks, cfg)}
    streamed = [(n, _digest(t)) for n, t in iter_stage_weights(chunks, bucket_bytes=4 * UNIT, unit_bytes=UNIT,
                                                                expert_senders=True)]
    union = [None] * world
    dist.all_gather_object(union, old)
    from megatron.core import parallel_state as mpu

    return {"rank": rank, "sender": is_sender_rank(expert_senders=True), "stage_sender": is_sender_rank(),
            "group": sender_group_name(expert_senders=True), "ep_rank": mpu.get_expert_model_parallel_rank(),
            "streamed": streamed, "union": {k: v for part in union for k, v in part.items()}}


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    from megarl.parallel import spawn

    d = str(tmp_path_factory.mktemp("experts") / "moe")
    make_tiny_hf_model(d, "qwen3_moe", std=0.1, vocab_size=160, tie_word_embeddings=False)
    return spawn(_all_layouts, 4, d, timeout_s=600)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_senders_stream_every_tensor_once_without_transfers(streams, layout):
    tp, pp, ep, etp = LAYOUTS[layout]
    res = [r[layout] for r in streams]
    union = res[0]["union"]
    senders = [r for r in res if r["sender"]]
    assert len(senders) == pp * ep, "one sender per stage and expert-parallel rank"
    assert len({r["group"] for r in senders}) == len(senders), "each sender has its own update group"
    for r in res:
        if not r["sender"]:
            assert r["streamed"] == [], f"rank {r['rank']} is no sender but yielded tensors"
    names = [n for r in senders for n, _ in r["streamed"]]
    assert len(names) == len(set(names)), "a tensor was streamed twice"
    assert dict(n_d for r in senders for n_d in r["streamed"]) == union
    local = 4 // ep                                   # the tiny MoE has 4 experts
    for r in senders:
        experts = {int(n.split(".")[5]) for n, _ in r["streamed"] if ".experts." in n}
        assert experts == set(range(r["ep_rank"] * local, (r["ep_rank"] + 1) * local)), (r["rank"], experts)
        if not r["stage_sender"]:
            assert all(".experts." in n for n, _ in r["streamed"]), "an expert sender sends experts only"


def _push(rank, world, hf_dir, url):
    import contextlib

    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.rollout.client import SGLangClient, sampling_params
    from megarl.sync.push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
    from megarl.sync.session import weight_update_session

    apply_cpu_shim()
    init_model_parallel(tp=1, ep=2)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    g = torch.Generator().manual_seed(100)           # same on every rank: replicated weights stay equal
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def server_sample():
        async def go():
            async with SGLangClient(url) as c:
                return (await c.generate(PROMPT, sampling_params(max_new_tokens=10, temperature=1.0,
                                                                 sampling_seed=7)))[0]
        return asyncio.run(go())

    def trainer_lp(out_ids):
        logits = forward_logits(chunks, torch.tensor([PROMPT + out_ids]))
        lp = torch.log_softmax(logits[0].float(), -1)
        return torch.stack([lp[len(PROMPT) - 1 + i, t] for i, t in enumerate(out_ids)])

    def gap() -> float:
        obj = [server_sample() if rank == 0 else None]
        dist.broadcast_object_list(obj, src=0)
        return (trainer_lp(obj[0].output_ids) - torch.tensor(obj[0].logprobs)).abs().max().item()

    before = gap()
    pusher = None
    if is_sender_rank(expert_senders=True):
        pusher = WeightPusher([url], bucket_mb=0.02, group_name=sender_group_name(expert_senders=True))
        pusher.connect()
    with weight_update_session([url]) if rank == 0 else contextlib.nullcontext():
        dist.barrier()
        stats = push_megatron(chunks, cfg, pusher, weight_version="step1", expert_senders=True)
        dist.barrier()
    if pusher:
        pusher.close()
    dist.barrier()
    return {"before": before, "after": gap(), "sender": pusher is not None, "bytes": stats.bytes,
            "group": pusher.group_name if pusher else None}


def test_two_expert_senders_push_into_a_server(tmp_path):
    from megarl.parallel import spawn

    d = str(tmp_path / "moe")
    make_tiny_hf_model(d, "qwen3_moe", std=0.1, vocab_size=160)
    with ServerProcess(d) as s:
        res = spawn(_push, 2, d, s.url, timeout_s=300)
    assert [r["sender"] for r in res] == [True, True]
    assert sorted(r["group"] for r in res) == ["megarl_weights_pp0", "megarl_weights_pp0_ep1"]
    assert all(r["bytes"] > 0 for r in res)
    assert res[0]["before"] > 1e-2, "the trainer's weights should differ from the server's before the push"
    assert res[0]["after"] < 1e-4, res
