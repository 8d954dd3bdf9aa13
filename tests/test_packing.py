"""Sequence packing and the sharded data path.

Planning (token-balanced data-parallel shards, packed micro-batches, equal micro-batch counts),
flat batches and their reassembly are checked against direct definitions. The model side runs real
megatron workers (MegatronWorker, gloo ranks): for every family, logprobs of packed micro-batches
equal those of padded ones (< 1e-5, fp32) and HF transformers' per-sequence forward (< 1e-4, the
tolerance of test_models), and one training step gives the same loss terms and grad norm (< 1e-5)
packed or padded, at one rank and at dp2 / tp2 / pp2 / ep2.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import make_tiny_hf  # noqa: E402

from megarl.data.batch import TokenBatch, segment_index  # noqa: E402
from megarl.data.packing import (balance, pack_bins, plan_ranges, plan_shards,  # noqa: E402
                                 stratified_minibatches)
from megarl.parallel import spawn  # noqa: E402
from megarl.workers.batch import packed_inputs, padded_inputs  # noqa: E402
from megarl.workers.dispatch import make_shards, unshard  # noqa: E402
from megarl.algos import LossSettings, PolicyLossConfig  # noqa: E402
from megarl.data.packing import denominators, minibatches  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]
ROOT = Path(__file__).resolve().parents[1]


def random_batch(n: int, seed: int, vocab: int = 160, max_len: int = 24) -> TokenBatch:
    g = random.Random(seed)
    prompts, responses, lps = [], [], []
    for _ in range(n):
        total = g.randint(2, max_len)
        plen = g.randint(1, total - 1)
        prompts.append([g.randrange(vocab) for _ in range(plen)])
        responses.append([g.randrange(vocab) for _ in range(total - plen)])
        lps.append([-g.random() for _ in range(total - plen)])
    batch = TokenBatch.from_sequences(prompts, responses, {"rollout_logprobs": lps})
    f = batch.token_fields
    gen = torch.Generator().manual_seed(seed)
    f["old_logprobs"] = f["rollout_logprobs"] + 0.05 * torch.randn(f["rollout_logprobs"].shape, generator=gen)
    f["advantages"] = torch.randn(f["rollout_logprobs"].shape, generator=gen)
    f["old_values"] = torch.randn(f["rollout_logprobs"].shape, generator=gen)
    f["returns"] = torch.randn(f["rollout_logprobs"].shape, generator=gen)
    return batch


# ---------------------------------------------------------------------------------------------
# planning and flat batches (no model)
# ---------------------------------------------------------------------------------------------

def test_token_batch_select_pad_unpad_against_lists():
    batch = random_batch(9, seed=0)
    seqs = [batch.sequence(i).tolist() for i in range(len(batch))]
    index = [4, 0, 7, 7, 2]
    sub = batch.select(index)
    assert [sub.sequence(i).tolist() for i in range(len(sub))] == [seqs[i] for i in index]
    offs = batch.response_offsets
    per_sample = [batch.token_fields["advantages"][offs[i]:offs[i + 1]].tolist() for i in range(len(batch))]
    assert sub.token_fields["advantages"].tolist() == [x for i in index for x in per_sample[i]]
    padded = batch.padded(batch.token_fields["advantages"])
    for i, row in enumerate(per_sample):
        assert padded[i, :len(row)].tolist() == row and not padded[i, len(row):].any()
    assert torch.equal(batch.unpad(padded), batch.token_fields["advantages"])
    assert segment_index(torch.tensor([0, 3, 3, 5]), [2, 0]).tolist() == [3, 4, 0, 1, 2]
    again = TokenBatch.from_payload(batch.to_payload())
    assert torch.equal(again.tokens, batch.tokens) and torch.equal(again.token_fields["returns"],
                                                                   batch.token_fields["returns"])
    with pytest.raises(ValueError, match="prompt length"):
        TokenBatch(torch.arange(3), torch.tensor([0, 3]), torch.tensor([4]))


def test_balance_and_bins():
    g = random.Random(1)
    lengths = [int(g.lognormvariate(5, 1)) + 1 for _ in range(300)]
    parts = balance(lengths, 8)
    assert sorted(i for p in parts for i in p) == list(range(300))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # LPT: within one sample of each other
    bins = pack_bins(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(300))
    for b in bins:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 1024
    # best-fit decreasing is within a few bins of the ideal count here
    assert len(bins) <= -(-sum(min(x, 1024) for x in lengths) // 1024) + 3


def assert_micro_batches_follow(plan, minibatches, lengths, packed, max_tokens, mbs):
    """Every rank's micro-batches lie inside their mini-batch, within the token budget when packed
    (a single over-budget sample aside) and the sample count when fixed-size, and cover its samples."""
    for r in range(len(plan.samples)):
        start = 0
        for k, sizes in enumerate(plan.micro_sizes[r]):
            for m in sizes:
                ids = plan.samples[r][start:start + m]
                assert set(ids) <= set(minibatches[k])
                if packed and m > 1:
                    assert sum(lengths[i] for i in ids) <= max_tokens
                elif not packed and not max_tokens:
                    assert m <= mbs
                start += m
        assert start == len(plan.samples[r])


@pytest.mark.parametrize("packed,max_tokens,mbs", [(True, 64, 1), (False, 64, 1), (False, 0, 3)])
def test_plan_gives_every_rank_the_same_micro_batch_count(packed, max_tokens, mbs):
    g = random.Random(2)
    lengths = [g.randint(1, 70) for _ in range(37)] + [200]  # one sample above the budget
    minibatches = [list(range(0, 20)), list(range(20, 38))]
    plan = plan_shards(lengths, minibatches, 4, packed=packed, max_tokens=max_tokens, micro_batch_size=mbs,
                       micro_multiple=2)
    for k, mb in enumerate(minibatches):
        counts = {len(plan.micro_sizes[r][k]) for r in range(4)}
        assert len(counts) == 1 and counts.pop() % 2 == 0
    seen = [i for r in range(4) for i in plan.samples[r]]
    assert sorted(seen) == list(range(38))
    assert_micro_batches_follow(plan, minibatches, lengths, packed, max_tokens, mbs)


def test_unshard_inverts_the_plan():
    batch = random_batch(23, seed=3)
    plan = plan_shards(batch.seq_lens.tolist(), [list(range(23))], 3, packed=True, max_tokens=40)
    shards = make_shards(batch, plan, ("advantages",))
    per_rank = [s.batch.token_fields["advantages"] * 2 for s in shards]
    assert torch.equal(unshard(batch, plan, per_rank), batch.token_fields["advantages"] * 2)
    assert torch.equal(unshard(batch, plan, [s.batch.seq_lens for s in shards], per="sample"), batch.seq_lens)
    assert sum(len(s.batch) for s in shards) == 23 and all(not s.batch.sample_fields for s in shards)


def _forward_ranges(lengths, dp):
    """Each rank's samples in a forward pass (one mini-batch of the whole batch), as the group plans it."""
    plan = plan_shards(lengths, [list(range(len(lengths)))], dp, packed=True, max_tokens=10**9)
    return [sorted(s) for s in plan.samples]


@pytest.mark.parametrize("n,dp,gbs", [(103, 4, 16), (103, 1, 16), (64, 3, 64), (50, 4, 200), (3, 4, 2), (37, 2, 5)])
@pytest.mark.parametrize("packed,max_tokens,mbs", [(True, 64, 1), (False, 64, 1), (False, 0, 3)])
def test_stratified_minibatches_cover_the_batch_and_keep_each_rank_on_its_forward_range(n, dp, gbs, packed,
                                                                                         max_tokens, mbs):
    g = random.Random(n * 7 + dp)
    lengths = [g.randint(1, 70) for _ in range(n - 1)] + [200]  # one sample above the budget
    strat = stratified_minibatches(lengths, dp, gbs, seed=11)
    got = strat.minibatches
    plan = plan_ranges(lengths, strat, packed=packed, max_tokens=max_tokens, micro_batch_size=mbs, micro_multiple=2)
    # every sample in exactly one mini-batch; sizes as trainer.minibatches cuts them (short tail joins the last)
    assert sorted(i for mb in got for i in mb) == list(range(n))
    size = min(gbs, n)
    want = [size] * (n // size)
    want[-1] += n % size
    assert [len(mb) for mb in got] == want
    assert got == stratified_minibatches(lengths, dp, gbs, seed=11).minibatches       # seeded: the same again
    assert got != stratified_minibatches(lengths, dp, gbs, seed=12).minibatches or n <= dp
    if dp == 1:  # one rank: an ordinary seeded shuffle cut into mini-batches
        assert got == minibatches(n, gbs, 11)
    # rank r trains on exactly its forward range, micro-batches inside the right mini-batch and rank
    assert [sorted(s) for s in plan.samples] == _forward_ranges(lengths, dp)
    for k in range(len(got)):
        counts = {len(plan.micro_sizes[r][k]) for r in range(dp)}
        assert len(counts) == 1 and counts.pop() % 2 == 0
    assert_micro_batches_follow(plan, got, lengths, packed, max_tokens, mbs)


def test_stratified_minibatches_share_each_minibatch_in_proportion_to_the_ranges():
    """A rank's share of every mini-batch follows its range's size (so its tokens per mini-batch
    stay near 1/dp): within one sample of the proportional share."""
    g = random.Random(5)
    lengths = [g.randint(10, 1000) for _ in range(1000)]
    strat = stratified_minibatches(lengths, 4, 96, seed=0)
    total = len(lengths)
    for r, chunks in enumerate(strat.chunks):
        assert [i for c in chunks for i in sorted(c)] != list(strat.ranges[r]) or len(chunks) == 1  # shuffled
        assert sorted(i for c in chunks for i in c) == list(strat.ranges[r])
        for k, c in enumerate(chunks[:-1]):
            assert abs(len(c) - 96 * len(strat.ranges[r]) / total) <= 1.5, (r, k, len(c))


def test_training_shards_are_views_of_the_batch():
    """Stratified mini-batches: every rank's training shard shares storage with the batch (no copy
    on the driver) and holds the right samples; the global-shuffle plan gathers (copies)."""
    batch = random_batch(60, seed=6)
    lengths = batch.seq_lens.tolist()
    strat = stratified_minibatches(lengths, 3, 16, seed=2)
    mbs, plan = strat.minibatches, plan_ranges(lengths, strat, packed=True, max_tokens=40)
    fields = ("advantages", "old_logprobs")
    shards = make_shards(batch, plan, fields, denominators(batch.response_mask(), mbs))

    def within(t, base):
        lo, ptr = base.untyped_storage().data_ptr(), t.untyped_storage().data_ptr()
        return ptr == lo and t.data_ptr() >= lo and t.data_ptr() + t.numel() * t.element_size() <= \
            lo + base.untyped_storage().nbytes()

    ranges = _forward_ranges(lengths, 3)
    for r, shard in enumerate(shards):
        assert within(shard.batch.tokens, batch.tokens)
        for name in fields:
            assert within(shard.batch.token_fields[name], batch.token_fields[name])
        assert torch.equal(shard.batch.tokens, batch.select(ranges[r]).tokens)
        # the micro-batches the worker builds hold the planned samples of each mini-batch
        seen = []
        for k, micro in enumerate(shard.minibatches()):
            for mb in micro:
                seqs = [mb.sequence(i).tolist() for i in range(len(mb))]
                ids = [ranges[r][0] + shard.order[len(seen) + j] for j in range(len(mb))]
                assert seqs == [batch.sequence(i).tolist() for i in ids] and set(ids) <= set(mbs[k])
                seen += ids
        assert sorted(seen) == ranges[r]
    assert [d["num_seqs"] for d in shards[0].denominators] == [float(len(m)) for m in mbs]
    # the global-shuffle path over the same mini-batches gathers each rank's samples: copies
    gathered = make_shards(batch, plan_shards(lengths, mbs, 3, packed=True, max_tokens=40), fields)
    assert not any(within(s.batch.tokens, batch.tokens) for s in gathered)


def _group(dp, packing=True):
    """A WorkerGroup shell: planning only (no ranks)."""
    from types import SimpleNamespace as NS

    from megarl.workers.group import WorkerGroup

    role = NS(packing=packing, micro_batch_size=2, max_tokens_per_micro_batch=40, parallel=NS(pp=1, vpp=1, cp=1))
    group = WorkerGroup.__new__(WorkerGroup)
    group.role, group.cfg, group.role_cfg = "critic", NS(critic=role), role
    group._topology = [{"dp_rank": r, "dp": dp} for r in range(dp)]
    return group


def test_group_plans_stratified_minibatches_on_ranges_and_falls_back_for_another_dp():
    batch = random_batch(45, seed=7)
    lengths = batch.seq_lens.tolist()
    strat = _group(3).minibatches(batch, 8, seed=4)
    assert strat.minibatches == stratified_minibatches(lengths, 3, 8, 4).minibatches
    same = _group(3).plan(batch, strat)
    assert same == plan_ranges(lengths, strat, packed=True, max_tokens=40, micro_batch_size=2)
    assert [sorted(s) for s in same.samples] == _forward_ranges(lengths, 3)
    other = _group(2).plan(batch, strat)   # a critic with another dp: plain mini-batches, exact balance
    assert other == plan_shards(lengths, strat.minibatches, 2, packed=True, max_tokens=40, micro_batch_size=2)
    assert _group(2).plan(batch, strat.minibatches) == other


def test_packed_and_padded_inputs_read_the_same_predictions():
    """pred_index/next_ids pick, for response token j of sample i, the row of the token before it
    and the token itself, in both layouts."""
    batch = random_batch(6, seed=4)
    for mi in (packed_inputs(batch), padded_inputs(batch)):
        flat_ids = mi.input_ids.reshape(-1)
        keep = mi.mask.bool()
        targets = mi.next_ids[mi.pred_index][keep]
        assert torch.equal(targets, batch.tokens[batch.response_token_index()])
        assert torch.equal(flat_ids[mi.last_index], batch.tokens[batch.seq_offsets[1:] - 1])
    mi = packed_inputs(batch, pad_to_multiple=8)
    assert mi.input_ids.shape[1] % 8 == 0 and mi.packed.seq_lens[:6] == tuple(batch.seq_lens.tolist())
    pos = mi.position_ids[0, :batch.num_tokens]
    assert torch.equal(pos, torch.cat([torch.arange(n) for n in batch.seq_lens.tolist()]))


# ---------------------------------------------------------------------------------------------
# real megatron workers: packed == padded == HF
# ---------------------------------------------------------------------------------------------

def _cfg(hf_dir: str, world: int, layout: dict, packing: bool, value_head: bool = False):
    from megarl.config import load_config

    role = "critic" if value_head else "actor"
    over = [f"model.hf_path={hf_dir}", "cluster.backend=ray", f"{role}.enabled=true", f"{role}.gpus={world}",
            f"{role}.packing={str(packing).lower()}", f"{role}.optim.lr=1e-3", f"{role}.optim.clip_grad=0",
            "trainer.total_steps=1", "batch.global_batch_size=8", "model.arch.tie_word_embeddings=false"]
    if value_head:
        over.append("algorithm.advantage=gae")
    # vpp: set after validation, which refuses VPP *training* on CPU; these ranks run it forward-only
    over += [f"{role}.parallel.{k}={v}" for k, v in layout.items() if k != "vpp"]
    # packed: token budget that cuts the batch into several micro-batches; padded: 4 samples each
    over += [f"{role}.max_tokens_per_micro_batch=40"] if packing else [f"{role}.micro_batch_size=4"]
    over += [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                           "num_kv_heads", "vocab_size", "head_dim")]
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml", over)
    getattr(cfg, role).parallel.vpp = layout.get("vpp", 1)
    return cfg, role


ALGO = LossSettings(policy_loss="ppo", entropy_coef=0.01, value_clip=0.2, kl_loss_coef=0.0, kl_estimator="k3",
                    policy=PolicyLossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None, agg_mode="token-mean",
                                            norm_len=32.0))


def randomize_value_head(worker) -> None:
    """The HF causal-LM checkpoint has no score head (zeros): give a critic values worth comparing."""
    from megarl.models import unwrap

    last = unwrap(worker.chunks[-1])
    if last.post_process:
        with torch.no_grad():
            last.output_layer.weight.copy_(torch.randn(last.output_layer.weight.shape,
                                                       generator=torch.Generator().manual_seed(0)))


def _worker_pass(rank, world, hf_dir, batch, runs, train):
    """For each (layout, packing, value_head) of ``runs``, one worker on this rank: forward over the whole batch
    (its data-parallel shard), then one optimizer step over it as one mini-batch; plans made as the
    driver's WorkerGroup makes them."""
    from megatron.core import parallel_state as mpu

    from megarl.parallel import destroy_model_parallel
    from megarl.workers import MegatronWorker, WorkerSpec
    from megarl.workers.group import token_budget

    outs = []
    for layout, packing, value_head in runs:
        cfg, role = _cfg(hf_dir, world, layout, packing, value_head)
        spec = WorkerSpec(role=role, cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=0,
                          trainable=True, value_head=value_head)
        worker = MegatronWorker(spec)
        worker.setup()
        if value_head:
            randomize_value_head(worker)
        r = getattr(cfg, role)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()

        def plan(minibatches):
            return plan_shards(batch.seq_lens.tolist(), minibatches, dp, packed=packing,
                               max_tokens=token_budget(cfg, role), micro_batch_size=r.micro_batch_size,
                               micro_multiple=r.parallel.pp if r.parallel.vpp > 1 else 1)

        out = {"dp": dp, "dp_rank": dp_rank}
        shard = make_shards(batch, plan([list(range(len(batch)))]))[dp_rank]
        out["forward"] = worker.compute_values(shard) if value_head else worker.compute_logprobs(shard, True)
        out["micro_counts"] = [len(s) for s in shard.micro_sizes]
        if train and layout.get("vpp", 1) == 1:
            mask = batch.response_mask()
            dens = [{"num_tokens": float(mask.sum()), "num_seqs": float(len(batch))}]
            fields = ("old_values", "returns") if value_head else ("old_logprobs", "advantages", "rollout_logprobs")
            out["train"] = worker.train_batch(make_shards(batch, plan([list(range(len(batch)))]), fields, dens)[dp_rank],
                                        ALGO)
        destroy_model_parallel()
        outs.append(out)
    return outs


def _collect(results, batch, hf_dir, layout, packing, world, value_head):
    """Reassemble forward results from the output ranks as the WorkerGroup does; train metrics of
    the output ranks merged (sums added over data-parallel ranks)."""
    from megarl.workers.group import token_budget

    cfg, role = _cfg(hf_dir, world, layout, packing, value_head)
    r = getattr(cfg, role)
    dp = results[0]["dp"]
    plan = plan_shards(batch.seq_lens.tolist(), [list(range(len(batch)))], dp, packed=packing,
                       max_tokens=token_budget(cfg, role), micro_batch_size=r.micro_batch_size,
                       micro_multiple=r.parallel.pp if r.parallel.vpp > 1 else 1)
    by_dp = {res["dp_rank"]: res["forward"]["token"] for res in results if res["forward"]}
    assert sorted(by_dp) == list(range(dp))
    fwd = {k: unshard(batch, plan, [torch.as_tensor(by_dp[d][k]) for d in range(dp)]) for k in by_dp[0]}
    metrics = [res["train"] for res in results if res.get("train")]
    merged = {}
    for m in metrics:
        for k, v in m.items():
            merged[k] = merged.get(k, 0.0) + v if k.endswith("_sum") else v
    return fwd, merged, results[0]["micro_counts"]


def _hf_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for i in range(len(batch)):
            seq = batch.sequence(i)
            lp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
            p = int(batch.prompt_lens[i])
            out.append(lp[p - 1:-1].gather(-1, seq[p:, None])[:, 0])
    return torch.cat(out)


def _compare(family, hf_dir, model, batch, world, layouts, critic=False, train=True):
    """Packed vs padded (and HF) for each layout; ``critic`` adds a value-head worker per layout."""
    ref = _hf_logprobs(model, batch)
    runs = [(layout, packing, vh) for layout in layouts for vh in ((False, True) if critic else (False,))
            for packing in (True, False)]
    per_rank = spawn(_worker_pass, world, hf_dir, batch, runs, train, timeout_s=900)
    for k in range(0, len(runs), 2):
        layout, _, value_head = runs[k]
        fp, mp_, counts_p = _collect([r[k] for r in per_rank], batch, hf_dir, layout, True, world, value_head)
        fd, md, counts_d = _collect([r[k + 1] for r in per_rank], batch, hf_dir, layout, False, world, value_head)
        where = f"{family} {'critic' if value_head else 'actor'} {layout} world {world}"
        assert counts_p != counts_d or world > 1, f"{where}: both layouts cut the same micro-batches"
        for key in fp:
            diff = (fp[key] - fd[key]).abs().max().item()
            assert diff < 1e-5, f"{where}: packed vs padded {key} differ by {diff}"
        if not value_head:
            diff = (fp["logprobs"] - ref).abs().max().item()
            assert diff < 1e-4, f"{where}: packed logprobs vs HF differ by {diff}"
        if train and layout.get("vpp", 1) == 1:  # see TWO_RANKS
            keys = [k for k in md if k.endswith("_sum")] + ["grad_norm"]
            assert md["grad_norm"] > 0 and len(keys) >= 2
            for key in keys:
                assert abs(mp_[key] - md[key]) < 1e-5 * max(1.0, abs(md[key])), \
                    f"{where}: {key} packed {mp_[key]} padded {md[key]}"


# two-rank layouts per family: together they cover dp (token-balanced shards), tp, pp, pp + vpp, ep, MLA.
# pp2 + vpp2 is compared forward-only: megatron's interleaved schedule sends activations and gradients
# to the same peer in one exchange, which untagged gloo p2p can pair the wrong way round (training
# with it on gloo gives wrong gradients packed and padded alike; it needs NCCL).
TWO_RANKS = {"llama": [{}, {"pp": 2, "vpp": 2}], "qwen2": [{"tp": 2}], "qwen3": [{"pp": 2}],
             "qwen3_moe": [{"ep": 2}], "deepseek_v3": [{"ep": 2}]}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_and_hf_for_every_family(family, tmp_path):
    """Actor (and, for qwen2, critic) logprobs/values and one training step, packed vs padded."""
    model = make_tiny_hf(family, tmp_path, **({"num_hidden_layers": 4} if family == "llama" else {}))
    batch = random_batch(12, seed=5)
    _compare(family, str(tmp_path), model, batch, 1, [{}], critic=family == "qwen2")
    _compare(family, str(tmp_path), model, batch, 2, TWO_RANKS[family])


def _train_epoch(rank, world, hf_dir, batch, strat):
    """One rank: an epoch of optimizer steps over the stratified mini-batches ``strat`` (drawn for two
    ranks), planned as WorkerGroup.train plans them: on the ranks' ranges at dp 2, the same
    mini-batches on one rank at dp 1. Returns the metrics and per-parameter checksums after it."""
    from megatron.core import parallel_state as mpu

    from megarl.parallel import destroy_model_parallel
    from megarl.workers import MegatronWorker, WorkerSpec
    from megarl.workers.group import token_budget

    cfg, role = _cfg(hf_dir, world, {}, True)
    worker = MegatronWorker(WorkerSpec(role=role, cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=0, trainable=True, value_head=False))
    worker.setup()
    lengths = batch.seq_lens.tolist()
    budget = dict(packed=True, max_tokens=token_budget(cfg, role))
    dp = mpu.get_data_parallel_world_size()
    plan = plan_ranges(lengths, strat, **budget) if dp == strat.dp else \
        plan_shards(lengths, strat.minibatches, dp, **budget)
    dens = denominators(batch.response_mask(), strat.minibatches)
    shard = make_shards(batch, plan, ("old_logprobs", "advantages", "rollout_logprobs"), dens)
    metrics = worker.train_batch(shard[mpu.get_data_parallel_rank()], ALGO)
    sums = {n: (float(p.detach().double().sum()), float(p.detach().double().square().sum()))
            for c in worker.chunks for n, p in c.named_parameters()}
    destroy_model_parallel()
    return {"metrics": metrics, "sums": sums, "samples": [len(s.batch) for s in shard]}


def test_stratified_epoch_at_dp2_equals_dp1_on_the_same_minibatches(tmp_path):
    """Three optimizer steps over stratified mini-batches: two ranks on their contiguous ranges give
    the loss terms, grad norms and weights of one rank training on the same global mini-batches
    (global denominators; fp32 < 1e-5)."""
    from megarl.workers.group import WorkerGroup

    make_tiny_hf("llama", tmp_path)
    batch = random_batch(24, seed=8)
    strat = stratified_minibatches(batch.seq_lens.tolist(), 2, 8, seed=3)
    assert [len(m) for m in strat.minibatches] == [8, 8, 8]
    one = spawn(_train_epoch, 1, str(tmp_path), batch, strat, timeout_s=600)
    two = spawn(_train_epoch, 2, str(tmp_path), batch, strat, timeout_s=600)
    assert two[0]["samples"] == [len(r) for r in strat.ranges] and one[0]["samples"] == [24]
    merge = WorkerGroup.__new__(WorkerGroup).reduce_metrics
    m1, m2 = merge([r["metrics"] for r in one]), merge([r["metrics"] for r in two])
    # loss terms are sums with global denominators (the rest, e.g. clip_frac, are means over micro-batches)
    keys = ["actor/pg_loss", "actor/entropy", "actor/loss", "grad_norm"]
    assert m1["grad_norm"] > 0 and m1.keys() == m2.keys()
    for key in keys:
        assert abs(m1[key] - m2[key]) < 1e-5 * max(1.0, abs(m1[key])), (key, m1[key], m2[key])
    for name, (s, sq) in one[0]["sums"].items():
        for r in range(2):
            s2, sq2 = two[r]["sums"][name]
            assert abs(s - s2) < 1e-5 * max(1.0, abs(s)) and abs(sq - sq2) < 1e-5 * max(1.0, sq), name
