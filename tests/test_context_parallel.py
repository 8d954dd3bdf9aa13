"""Context parallelism for packed (THD) micro-batches without Transformer Engine.

Layout and positions are checked against direct definitions and megatron's own zig-zag RoPE
slicing. The model side runs real megatron workers (MegatronWorker, megatron parallel_state with
context_parallel_size, gloo ranks, DDP + finalize_model_grads): on packed batches of odd and uneven
lengths, CP2 (a critic: values and value loss), CP2xTP2, CP2xPP2 and CP2xEP2 (MoE, replaying random
recorded experts: R3 routes sliced like the tokens) give the logprobs/entropy or values, loss terms,
grad norm,
every parameter's reduced gradient (``main_grad``) and the weights after the optimizer step of the
same layout at CP1 (fp32, < 1e-5). All layouts share one spawned group of four processes.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_utils import make_tiny_hf  # noqa: E402
from test_packing import ALGO, random_batch, randomize_value_head  # noqa: E402

from megarl.models.context_parallel import CPSplit, cp_padded_len, zigzag_rows  # noqa: E402
from megarl.models.packed import cp_positions, pack_params  # noqa: E402
from megarl.parallel import spawn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# layout (no ranks)
# ---------------------------------------------------------------------------------------------

@pytest.mark.unit
def test_zigzag_split_covers_every_row_once_and_balances_causal_work():
    lens = [cp_padded_len(n, 2) for n in (5, 1, 12, 7)]
    assert lens == [8, 4, 12, 8]
    rows = [zigzag_rows(lens, 2, r) for r in range(2)]
    assert sorted(torch.cat(rows).tolist()) == list(range(sum(lens)))
    # rank 0 holds chunks 0 and 3 of the first sequence (2 tokens each), rank 1 chunks 1 and 2
    assert rows[0][:4].tolist() == [0, 1, 6, 7] and rows[1][:4].tolist() == [2, 3, 4, 5]
    pos = torch.cat([torch.arange(n) for n in lens])
    assert pos[rows[0]].sum() == pos[rows[1]].sum()   # equal causal work per rank
    split = CPSplit.build(lens, 2, 1)
    gathered = torch.cat([pos[r] for r in rows])
    assert torch.equal(gathered[split.global_order], pos)


@pytest.mark.unit
def test_cp_micro_inputs_slice_tokens_targets_and_keep_global_read_indices():
    from megarl.workers.batch import micro_inputs, packed_inputs

    batch = random_batch(5, seed=3, max_len=13)
    whole = packed_inputs(batch)
    parts = [micro_inputs(batch, True, pad_to_multiple=2, cp=2, cp_rank=r) for r in range(2)]
    lens = [cp_padded_len(n, 2) for n in batch.seq_lens.tolist()]
    total = parts[0].cp.global_order.numel()
    assert total % 8 == 0 and total >= sum(lens) and parts[0].input_ids.numel() == total // 2
    ids = torch.zeros(total, dtype=torch.long)
    ids[parts[0].token_rows] = batch.tokens
    for r, mi in enumerate(parts):
        assert torch.equal(mi.input_ids[0], ids[mi.cp.local_rows])
        assert torch.equal(mi.next_ids, torch.roll(ids, -1)[mi.cp.local_rows])
        assert mi.packed.cp is mi.cp and mi.packed.max_seqlen_q == max(lens + [total - sum(lens)])
    # pred_index reads the same tokens' predictions in the padded global layout as in the plain one
    assert torch.equal(ids[parts[0].pred_index + 1][whole.mask.bool()],
                       whole.input_ids[0][whole.pred_index + 1][whole.mask.bool()])
    empty = micro_inputs(batch.select([]), True, pad_to_multiple=2, cp=2, cp_rank=1)
    assert empty.empty and empty.input_ids.numel() == 4 and empty.cp.padded_lens == (8,)


@pytest.mark.unit
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_positions_equal_megatron_zigzag_rope_slicing(cp):
    from megatron.core.models.common.embeddings.rope_utils import _get_thd_freqs_on_this_cp_rank

    lens = [cp_padded_len(n, cp) for n in (3, 17, 9, 1)]
    cu = pack_params(lens).cu_seqlens_q
    freqs = torch.arange(max(lens)).float().view(-1, 1, 1, 1)
    for r in range(cp):
        local = sum(lens) // cp
        mine = cp_positions(cu, local, cp, r)
        theirs = torch.cat([_get_thd_freqs_on_this_cp_rank(r, cp, torch.zeros(n // cp), freqs) for n in lens])
        assert mine.tolist() == theirs.view(-1).long().tolist()
        assert mine.tolist() == torch.cat([torch.arange(n) for n in lens])[zigzag_rows(lens, cp, r)].tolist()


@pytest.mark.unit
def test_varlen_chunks_attend_each_local_chunk_to_its_key_prefix(monkeypatch):
    """The CUDA path's call layout, run here with a stand-in for the varlen kernel that does what
    FlashAttention's varlen causal does when a query block is shorter than its keys (bottom-right
    aligned): each rank's output equals whole-sequence causal attention at its rows."""
    import torch.nn.functional as F

    from megarl.models import context_parallel, packed_attention

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        outs = []
        for i in range(cu_q.numel() - 1):
            qs, ks, vs = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
            nq, nk = qs.shape[0], ks.shape[0]
            allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
            o = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (qs, ks, vs)), attn_mask=allowed,
                                               scale=scale, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(packed_attention, "_varlen", varlen)
    cp = 2
    lens = [cp_padded_len(n, cp) for n in (7, 1, 13)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, 8, generator=g) for h in (4, 2, 2))
    ref = packed_attention._per_sequence(q, k, v, lens, 0.3)
    for r in range(cp):
        split = CPSplit.build(lens, cp, r)
        out = context_parallel._varlen_chunks(q[split.local_rows], k, v, split, 0.3)
        assert (out - ref[split.local_rows]).abs().max() < 1e-6


def _cfg(hf_dir: str, world: int, layout: dict, role: str = "actor", **extra):
    from megarl.config import load_config

    over = [f"model.hf_path={hf_dir}", "cluster.backend=ray", f"{role}.enabled=true", f"{role}.gpus={world}",
            f"{role}.packing=true", f"{role}.optim.lr=1e-3", f"{role}.optim.clip_grad=0",
            f"{role}.optim.distributed_optimizer=false", "trainer.total_steps=3", "batch.global_batch_size=8",
            "model.arch.tie_word_embeddings=false", f"{role}.max_tokens_per_micro_batch=40",
            "rollout.max_prompt_len=16", "rollout.sampling.max_new_tokens=16"]
    over += ["algorithm.advantage=gae", f"actor.gpus={world}"] if role == "critic" else []
    over += [f"{role}.parallel.{k}={v}" for k, v in layout.items()]
    over += [f"{k}={v}" for k, v in extra.items()]
    over += [f"model.arch.{k}=0" for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                           "num_kv_heads", "vocab_size", "head_dim")]
    return load_config(ROOT / "recipes" / "smollm2-135m-grpo-cpu.yaml", over)


@pytest.mark.unit
def test_validation_accepts_cp_with_packing_and_names_the_budget_field(tmp_path):
    from megarl.config.validate import collect_problems
    from megarl.workers.group import plan_lengths, token_budget

    make_tiny_hf("llama", tmp_path)
    cfg = _cfg(str(tmp_path), 4, {"cp": 2})
    assert collect_problems(cfg) == []
    assert token_budget(cfg, "actor") == 80 and plan_lengths(cfg, "actor", [5, 8, 1]) == [8, 8, 4]
    cfg.actor.max_tokens_per_micro_batch = 15      # 30 tokens over the CP group < 32 (16 + 16)
    problems = collect_problems(cfg)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith("actor.max_tokens_per_micro_batch: 15 x cp 2 = 30 tokens"), problems
    cfg.actor.max_tokens_per_micro_batch, cfg.actor.packing = 40, False
    assert any(p.startswith("actor.packing: context parallel") for p in collect_problems(cfg))


# ---------------------------------------------------------------------------------------------
# real megatron workers: CP2 x {-, TP2, PP2, EP2} == the same layout at CP1
# ---------------------------------------------------------------------------------------------

def _with_routes(batch, layers: int = 2, top_k: int = 2, experts: int = 4):
    """The batch with random recorded experts per token and layer (R3), unlike the router's own."""
    g = torch.Generator().manual_seed(11)
    routes = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(batch.num_tokens * layers)])
    batch.seq_fields["routed_experts"] = routes.view(batch.num_tokens, layers, top_k).to(torch.int32)
    return batch


def _run(rank, world, hf_dir, batch, layout, kind="actor"):
    """One worker of ``layout`` (``kind``: actor, actor replaying R3 routes, or critic): forward
    (logprobs + entropy, or values) over its data-parallel shard, one optimizer step over the batch
    as one mini-batch; returns results, metrics, every parameter's reduced gradient and its value
    after the step (by name: same layout, same shard per rank)."""
    from megatron.core import parallel_state as mpu

    from megarl.data.packing import plan_shards
    from megarl.parallel import destroy_model_parallel
    from megarl.workers import MegatronWorker, WorkerSpec
    from megarl.workers.dispatch import make_shards
    from megarl.workers.group import plan_lengths, token_budget

    r3, critic = kind == "r3", kind == "critic"
    role = "critic" if critic else "actor"
    extra = {"algorithm.routing_replay": "rollout", "rollout.return_routed_experts": "true"} if r3 else {}
    cfg = _cfg(hf_dir, world, layout, role, **extra)
    worker = MegatronWorker(WorkerSpec(role=role, cfg=cfg, rank=rank, world_size=world, master_addr="127.0.0.1",
                                       master_port=0, trainable=True, value_head=critic))
    worker.setup()
    if critic:
        randomize_value_head(worker)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    lengths = plan_lengths(cfg, role, batch.seq_lens.tolist())
    plan = plan_shards(lengths, [list(range(len(batch)))], dp, packed=True, max_tokens=token_budget(cfg, role))
    out = {"dp": dp, "dp_rank": dp_rank, "plan": plan}
    routes = ("routed_experts",) if r3 else ()
    forward = make_shards(batch, plan, routes)[dp_rank]
    out["forward"] = worker.compute_values(forward) if critic else worker.compute_logprobs(forward, True)
    mask = batch.response_mask()
    dens = [{"num_tokens": float(mask.sum()), "num_seqs": float(len(batch))}]
    fields = ("old_values", "returns") if critic else ("old_logprobs", "advantages", "rollout_logprobs") + routes
    shard = make_shards(batch, plan, fields, dens)[dp_rank]
    out["train"] = worker.train_batch(shard, ALGO)
    out["grads"] = {n: p.main_grad.detach().clone() for c in worker.chunks for n, p in c.named_parameters()}
    out["params"] = {n: p.detach().clone() for c in worker.chunks for n, p in c.named_parameters()}
    destroy_model_parallel()
    return out


def _cp_layouts(rank, world, dirs, batch, pairs):
    return [[_run(rank, world, dirs[family], _with_routes(batch) if kind == "r3" else batch, layout, kind)
             for layout in pair] for family, pair, kind in pairs]


def _forward(results, batch):
    from megarl.workers.dispatch import unshard

    by_dp = {r["dp_rank"]: r["forward"]["token"] for r in results if r["forward"]}
    dp = results[0]["dp"]
    assert sorted(by_dp) == list(range(dp))
    return {k: unshard(batch, results[0]["plan"], [torch.as_tensor(by_dp[d][k]) for d in range(dp)])
            for k in by_dp[0]}


# (family, (CP1 layout, CP2 layout), kind): the plain CP2 pair is a critic (value pass and value loss;
# the actor at plain CP2 runs in test_grpo_three_steps_at_cp2_equal_cp1); the MoE actor replays random
# recorded experts (R3)
PAIRS = [("llama", ({}, {"cp": 2}), "critic"), ("llama", ({"tp": 2}, {"tp": 2, "cp": 2}), "actor"),
         ("llama", ({"pp": 2}, {"pp": 2, "cp": 2}), "actor"), ("qwen3_moe", ({"ep": 2}, {"ep": 2, "cp": 2}), "r3")]


def test_cp2_equals_cp1_with_tp_pp_ep_on_odd_uneven_packed_batches(tmp_path):
    """Forward logprobs/entropy, loss terms, grad norm, every reduced gradient and the weights after
    one step: CP2 equals CP1 in each layout (fp32, < 1e-5)."""
    from megarl.workers.group import WorkerGroup

    dirs = {}
    for family in ("llama", "qwen3_moe"):
        dirs[family] = str(tmp_path / family)
        make_tiny_hf(family, tmp_path / family)
    batch = random_batch(11, seed=7, max_len=29)     # odd count, uneven (and odd) lengths
    assert any(n % 4 for n in batch.seq_lens.tolist())
    per_rank = spawn(_cp_layouts, 4, dirs, batch, PAIRS, timeout_s=600)
    for k, (family, (ref_layout, cp_layout), kind) in enumerate(PAIRS):
        ref, cp = [r[k][0] for r in per_rank], [r[k][1] for r in per_rank]
        where = f"{family} {kind} {cp_layout} vs {ref_layout}"
        f1, f2 = _forward(ref, batch), _forward(cp, batch)
        assert sorted(f1) == (["values"] if kind == "critic" else ["entropy", "logprobs"])
        for key in f1:
            assert f1[key].abs().max() > 0
            diff = (f1[key] - f2[key]).abs().max().item()
            assert diff < 1e-5, f"{where}: {key} differ by {diff}"
        merge = WorkerGroup.__new__(WorkerGroup).reduce_metrics   # sums added over data-parallel output ranks
        m1, m2 = merge([r["train"] for r in ref]), merge([r["train"] for r in cp])
        assert m1["grad_norm"] > 0
        keys = ("critic/vf_loss",) if kind == "critic" else ("actor/pg_loss", "actor/entropy", "actor/loss")
        for key in keys + ("grad_norm",):
            assert abs(m1[key] - m2[key]) < 1e-5 * max(1.0, abs(m1[key])), f"{where}: {key} {m1[key]} {m2[key]}"
        for rank in range(4):
            g1, g2 = ref[rank]["grads"], cp[rank]["grads"]
            assert g1.keys() == g2.keys() and g1
            for name in g1:
                diff = (g1[name] - g2[name]).abs().max().item()
                assert diff < 1e-5, f"{where} rank {rank}: grad of {name} differs by {diff}"
                diff = (ref[rank]["params"][name] - cp[rank]["params"][name]).abs().max().item()
                assert diff < 1e-5, f"{where} rank {rank}: {name} after the step differs by {diff}"


# ---------------------------------------------------------------------------------------------
# planner and the long-reasoning recipe
# ---------------------------------------------------------------------------------------------

RECIPE = ROOT / "recipes" / "qwen3-8b-dapo-32k-cp.yaml"


@pytest.mark.unit
def test_planner_divides_activations_by_cp_and_counts_the_kv_exchange():
    from megarl.config import load_config
    from megarl.planning.memory import plan_role

    one = plan_role(load_config(RECIPE, ["actor.parallel.cp=1", "actor.max_tokens_per_micro_batch=34816"]), "actor")
    four = plan_role(load_config(RECIPE), "actor")
    kv = 4 * 128 * 2    # Qwen3-8B: 8 KV heads / tp2, head 128, bf16
    assert four.cp_kv_bytes_per_layer == 2 * 3 * 8704 * kv          # K and V from the 3 other ranks
    assert abs(four.cp_kv_seconds_per_layer - 2 * four.cp_kv_bytes_per_layer / 300e9) < 1e-12
    gathered = 36 * (2 * 4 + 1) * 8704 * kv                         # key prefixes kept for the backward, 36 layers
    assert four.activations == pytest.approx(one.activations / 4 + gathered, rel=1e-6)
    assert four.logits == pytest.approx(one.logits / 4, rel=1e-6)
    assert one.cp_kv_bytes_per_layer == 0 and any("cp4: per layer" in n for n in four.notes)


@pytest.mark.unit
def test_long_reasoning_recipe_fits_with_cp_and_the_plan_suggests_cp_without_it():
    from megarl.config import load_config
    from megarl.planning.memory import make_plan

    assert make_plan(load_config(RECIPE)).fits
    for budget in (34816, 8704):   # a 34816-token sample is one micro-batch whatever the budget
        plan = make_plan(load_config(RECIPE, ["actor.parallel.cp=1", f"actor.max_tokens_per_micro_batch={budget}"]))
        assert not plan.fits and plan.problems[0].startswith("actor: phase 'train:actor'")
        assert any(s.startswith("actor: fits with actor.parallel.cp=4 and actor.gpus=16") for s in plan.suggestions), \
            plan.suggestions


# ---------------------------------------------------------------------------------------------
# a whole GRPO run (Trainer, Ray ranks, real rollout server): CP2 == CP1
# ---------------------------------------------------------------------------------------------

def _exported(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(run.rglob("*.safetensors"))
    assert files, f"no exported weights under {run}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.e2e
def test_grpo_three_steps_at_cp2_equal_cp1(tmp_path):
    """Three GRPO steps of the tiny run, CP1 (one local rank) vs CP2 (two Ray ranks splitting every
    sequence): same rollouts, losses, entropy and grad norms per step (< 1e-5) and the same exported
    weights (< 1e-5)."""
    from megarl.trainer import Trainer
    from tests.helpers.runs import tiny_model, tiny_run_config

    model = tiny_model(tmp_path / "models")
    common = ("trainer.eval_before_after=false",)
    one = Trainer(tiny_run_config(model, tmp_path / "cp1", *common)).run()["steps"]
    two = Trainer(tiny_run_config(model, tmp_path / "cp2", *common, "cluster.backend=ray", "actor.gpus=2",
                                  "actor.parallel.cp=2")).run()["steps"]
    assert len(one) == len(two) == 3
    for step, (a, b) in enumerate(zip(one, two)):
        assert a["reward/mean"] == b["reward/mean"], step   # identical rollouts (seeded per sample)
        for key in ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm"):
            assert abs(a[key] - b[key]) < 1e-5 * max(1.0, abs(a[key])), (step, key, a[key], b[key])
    w1, w2 = _exported(tmp_path / "cp1"), _exported(tmp_path / "cp2")
    assert w1.keys() == w2.keys()
    for name in w1:
        diff = (w1[name].double() - w2[name].double()).abs().max().item()
        assert diff < 1e-5, f"{name}: exported weights differ by {diff}"
    assert sum(float(w.double().sum()) for w in w1.values()) != 0.0
