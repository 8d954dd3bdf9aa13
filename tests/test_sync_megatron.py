"""Weight push from a TP2 megatron trainer (2 gloo ranks) to a real embedded server process:
afterwards the server's rollout logprobs equal the trainer's own forward (< 1e-4), dense and MoE;
with EP2 the second rank's experts reach the server through the stage's one sender."""
import asyncio

import pytest
import torch

from megarl.rollout.client import SGLangClient, sampling_params
from tests.helpers.servers import ServerProcess, make_tiny_hf_model

PROMPT = [3, 14, 15, 92, 65, 35]


def _trainer(rank, world, hf_dir, url, tp, ep, expert_senders=False, server_tp=1):
    import torch.distributed as dist
    from megarl.models import build_model, forward_logits, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
    from transformers import AutoConfig

    apply_cpu_shim()
    init_model_parallel(tp=tp, ep=ep)
    cfg = AutoConfig.from_pretrained(hf_dir)
    chunks = build_model(cfg)
    load_hf_weights(chunks, hf_dir)
    # a "training step": move every shard so the pushed weights differ from the server's
    g = torch.Generator().manual_seed(100)  # same on every rank: TP-replicated params stay equal
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)

    def server_sample():
        async def go():
            async with SGLangClient(url) as c:
                return (await c.generate(PROMPT, sampling_params(max_new_tokens=10, temperature=1.0, sampling_seed=7)))[0]
        return asyncio.run(go())

    def trainer_lp(out_ids):
        ids = torch.tensor([PROMPT + out_ids])
        logits = forward_logits(chunks, ids)
        lp = torch.log_softmax(logits[0].float(), -1)
        return torch.stack([lp[len(PROMPT) - 1 + i, t] for i, t in enumerate(out_ids)])

    obj = [server_sample() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    before = (trainer_lp(obj[0].output_ids) - torch.tensor(obj[0].logprobs)).abs().max().item()

    from megarl.sync.session import weight_update_session

    pusher = None
    if is_sender_rank(expert_senders=expert_senders):
        pusher = WeightPusher([url], bucket_mb=0.02, group_name=sender_group_name(expert_senders=expert_senders),
                              server_tp_sizes=[server_tp])
        pusher.connect()
    # the "driver" (rank 0) opens one session on the server around every sender's push
    with weight_update_session([url]) if rank == 0 else _nothing():
        dist.barrier()
        stats = push_megatron(chunks, cfg, pusher, weight_version="step1", expert_senders=expert_senders)
        dist.barrier()
    if pusher:
        pusher.close()
    dist.barrier()
    obj = [server_sample() if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    after = (trainer_lp(obj[0].output_ids) - torch.tensor(obj[0].logprobs)).abs().max().item()
    return {"before": before, "after": after, "stats": stats.as_dict(), "sender": pusher is not None,
            "version": obj[0].weight_version, "group": pusher.group_name if pusher else None}


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("family,ep", [("llama", 1), ("qwen3_moe", 1), ("qwen3_moe", 2)])
def test_tp2_megatron_push_matches_trainer_forward(tmp_path, family, ep):
    from megarl.parallel import spawn
    d = str(tmp_path / family)
    kw = dict(vocab_size=160, tie_word_embeddings=False)
    if family == "llama":
        kw["attention_bias"] = False
    make_tiny_hf_model(d, family, std=0.1, **kw)
    with ServerProcess(d) as s:
        res = spawn(_trainer, 2, d, s.url, 2 if ep == 1 else 1, ep, timeout_s=240)
    r0 = res[0]
    print(family, ep, r0)
    assert r0["before"] > 1e-3                     # the push changed something
    assert r0["after"] < 1e-4, r0["after"]         # server == trainer forward
    assert r0["version"] == "step1"
    senders = [r for r in res if r["sender"]]
    assert len(senders) == 1, "one sender (one update group) per pipeline stage, experts gathered to it"
    assert sum(r["stats"]["buckets"] for r in senders) > 1
    for r in senders:  # at most ~2 buckets held (a tensor bigger than a bucket is its own bucket)
        st = r["stats"]
        biggest = 160 * 64 * 4
        assert st["peak_extra_bytes"] <= 2 * max(st["bucket_bytes"], biggest) + biggest
