"""The refit time model (megarl/planning/refit.py): bytes per phase equal a hand count from a small
MoE's HF config, the send phase charges the link the layout shares, parallel senders shrink only
what they split, the cluster settings are bytes per second, and `megarl plan --json` carries the
refit. Nothing here depends on machine speed: every rate is given."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.config.schema import ModelArch
from megarl.config.validate import arch_from_hf
from megarl.planning.cli import plan_main
from megarl.planning.refit import (FP8_SCALE_OVERHEAD, GBPS, GPU_TENSOR_OVERHEAD_S, Layout, Rates, broadcast_senders, estimate,
                                   ipc_senders, node_ipc_senders, stage_bytes)

ROOT = Path(__file__).resolve().parent.parent
DSV3 = str(ROOT / "recipes/deepseek-v3-671b-grpo.yaml")                  # disaggregated: broadcast
DSV3_COLOCATED = str(ROOT / "recipes/deepseek-v3-671b-grpo-colocated.yaml")   # CUDA IPC

# a Qwen3-MoE-shaped config.json (the tests' tiny MoE, untied)
HF = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 160, "num_experts": 4, "moe_intermediate_size": 32,
      "num_experts_per_tok": 2, "tie_word_embeddings": False}
H, NH, NKV, HD, V, E, FE = 64, 4, 2, 16, 160, 4, 32
ATTN = H * NH * HD + 2 * H * NKV * HD + NH * HD * H            # q + k, v + o = 12288
EXPERTS = E * 3 * H * FE                                         # gate, up, down per expert = 24576
NORMS_ROUTER = 2 * H + E * H                                     # two RMSNorms + router = 384
EMB = V * H                                                       # 10240 (output layer the same)


def _arch() -> ModelArch:
    return ModelArch(**arch_from_hf(HF))


def _rates(**kw) -> Rates:
    base = dict(nvlink=10e9, network=1e9, nics_per_node=1, pack=20e9, convert=25e9, quantize=5e9, checksum=0.0, verify=0.0,
                write=40e9, ipc_receive=0.0, bucket_overhead_s=0.0)
    base.update(kw)
    return Rates(**base)


def _cpu_layout(tp: int, pp: int, ep: int, etp: int = 1) -> Layout:
    """Four trainer ranks on node 0, one TP1 server on node 1 (the netns benchmark's shape)."""
    return Layout(tp=tp, pp=pp, ep=ep, etp=etp, world=4, ranks_per_node=4, server_tp=1, servers=1,
                  server_first_node=1, server_ranks_per_node=1)


def test_stage_bytes_equal_a_hand_count_of_the_hf_config():
    st = stage_bytes(_arch(), [[0], [1]])
    assert st[0].tp_sharded == ATTN + EMB and st[1].tp_sharded == ATTN + EMB     # embedding / output layer
    assert st[0].replicated == NORMS_ROUTER and st[1].replicated == NORMS_ROUTER + H   # + final norm
    assert st[0].experts == st[1].experts == EXPERTS
    assert st[0].projections == st[1].projections == ATTN


def test_tp2_pp2_ep2_stage_senders_gather_and_send_the_hand_counted_bytes():
    elem = 4                                                       # fp32 on CPU
    st = stage_bytes(_arch(), [[0], [1]])
    senders = broadcast_senders(st, _cpu_layout(2, 2, 2), "stage", fp8=False, elem=elem)
    assert [s.rank for s in senders] == [0, 2]                     # TP0 / DP0 of each 2-rank stage block
    # TP peer: half the dense TP-sharded bytes; EP peer (the same rank here): half of the experts
    assert senders[0].gather_local == (ATTN + EMB) / 2 * elem + EXPERTS / 2 * elem
    assert senders[0].gather_remote == 0
    assert senders[0].payload == (ATTN + EMB + NORMS_ROUTER + EXPERTS) * elem
    assert senders[1].payload == (ATTN + EMB + NORMS_ROUTER + H + EXPERTS) * elem


def test_expert_senders_split_the_experts_and_drop_their_gather():
    elem = 4
    st = stage_bytes(_arch(), [[0, 1]])
    stage = broadcast_senders(st, _cpu_layout(1, 1, 2), "stage", fp8=False, elem=elem)
    expert = broadcast_senders(st, _cpu_layout(1, 1, 2), "expert", fp8=False, elem=elem)
    assert len(stage) == 1 and [s.rank for s in expert] == [0, 1]
    assert stage[0].gather_local == 2 * EXPERTS / 2 * elem                  # the other EP rank's experts
    assert expert[0].gather_local == 0 and expert[1].gather_local == 0
    assert expert[1].payload == 2 * EXPERTS / 2 * elem
    assert sum(s.payload for s in expert) == stage[0].payload              # the same bytes, split


def test_fp8_bytes_and_quantize_input():
    st = stage_bytes(_arch(), [[0], [1]])
    s0 = broadcast_senders(st, _cpu_layout(2, 2, 2), "stage", fp8=True, elem=2)[0]
    proj = ATTN + EXPERTS
    assert s0.quantize_in == proj * 2
    assert s0.payload == pytest.approx(proj * (1 + FP8_SCALE_OVERHEAD) + (EMB + NORMS_ROUTER) * 2)
    assert s0.held == (ATTN + EMB + NORMS_ROUTER + EXPERTS) * 2            # converted before quantizing


def test_one_shared_link_gains_nothing_from_parallel_senders_one_link_each_does():
    elem = 4
    st = stage_bytes(_arch(), [[0, 1]])
    total = (2 * ATTN + 2 * EMB + 2 * NORMS_ROUTER + H + 2 * EXPERTS) * elem
    kw = dict(transport="distributed", fp8=False, elem=elem, bucket_bytes=1 << 20)
    shared = _cpu_layout(1, 1, 2)
    one = estimate(st, shared, _rates(), shape="stage", **kw)
    two = estimate(st, shared, _rates(), shape="expert", **kw)
    assert one.phase("send").seconds == pytest.approx(total / 1e9)        # every byte through node 0's one veth
    assert two.phase("send").seconds == pytest.approx(total / 1e9)
    assert "network" in one.phase("send").link
    assert two.phase("gather").seconds == 0 < one.phase("gather").seconds
    # each rank on its own node with its own NIC, the server on a third: the two senders send at once
    apart = Layout(tp=1, pp=1, ep=2, etp=1, world=2, ranks_per_node=1, server_tp=1, servers=1,
                   server_first_node=2, server_ranks_per_node=1)
    s1 = estimate(st, apart, _rates(), shape="stage", **kw).phase("send")
    s2 = estimate(st, apart, _rates(), shape="expert", **kw).phase("send")
    biggest = (2 * ATTN + 2 * EMB + 2 * NORMS_ROUTER + H + EXPERTS) * elem   # dense + its own experts
    assert s1.seconds == pytest.approx(total / 1e9)
    assert s2.link.startswith("network of node 2") and s2.seconds == pytest.approx(total / 1e9)  # the server's NIC
    wide = estimate(st, apart, _rates(nics_per_node=4), shape="expert", **kw).phase("send")
    assert wide.seconds == pytest.approx(biggest / 1e9)                      # now the dense sender's own NIC


def test_phases_add_up_and_apply_counts_every_server_rank_byte():
    elem = 4
    st = stage_bytes(_arch(), [[0], [1]])
    r = _rates(checksum=8e9, verify=4e9, bucket_overhead_s=0.001)
    est = estimate(st, _cpu_layout(2, 2, 2), r, transport="distributed", shape="stage", fp8=False, elem=elem,
                   bucket_bytes=100_000)
    assert est.seconds == pytest.approx(sum(p.seconds for p in est.phases))
    total = est.payload_bytes
    assert est.phase("apply").seconds == pytest.approx(total / 4e9 + total / 40e9)
    biggest = max(s.payload for s in broadcast_senders(st, _cpu_layout(2, 2, 2), "stage", False, elem))
    assert est.phase("pack").seconds == pytest.approx(biggest / 20e9 + biggest / 8e9)
    assert est.phase("convert").seconds == pytest.approx(biggest / 25e9)
    assert est.phase("buckets").seconds == pytest.approx(2 * 0.001)     # 190 kB in 100 kB buckets


def test_ipc_every_rank_gathers_the_whole_model():
    elem = 2
    st = stage_bytes(_arch(), [[0], [1]])
    lay = Layout(tp=1, pp=2, ep=1, etp=1, world=2, ranks_per_node=1, server_tp=1, servers=2,
                 server_first_node=0, server_ranks_per_node=1)
    ranks = ipc_senders(st, lay, fp8=False, elem=elem)
    stage1 = (ATTN + EMB + NORMS_ROUTER + H + EXPERTS) * elem
    assert ranks[0].gather_remote == stage1 and ranks[0].gather_local == 0   # stage 1 from node 1
    assert ranks[0].payload == ranks[1].payload == sum((s.tp_sharded + s.replicated + s.experts) * elem for s in st)


def test_node_shape_fetches_the_served_model_once_per_node_and_shares_it_over_nvlink():
    """Two stages on two nodes of two ranks: each rank gathers its own stage's TP shards over NVLink
    and fetches half of the other node's stage over the network; the send phase is the in-node
    broadcast of every tensor."""
    elem = 2
    st = stage_bytes(_arch(), [[0], [1]])
    lay = Layout(tp=2, pp=2, ep=1, etp=1, world=4, ranks_per_node=2, server_tp=2, servers=2,
                 server_first_node=0, server_ranks_per_node=2)
    served = [(s.tp_sharded + s.replicated + s.experts) * elem for s in st]     # bf16: served = held
    ranks = node_ipc_senders(st, lay, fp8=False, elem=elem)
    assert ranks[0].gather_remote == pytest.approx(served[1] / 2)
    assert ranks[0].gather_local == pytest.approx(st[0].tp_sharded / 2 * elem)     # its TP peer's half
    assert ranks[3].gather_remote == pytest.approx(served[0] / 2) and ranks[3].payload == pytest.approx(sum(served) / 2)
    rates = _rates(nvlink=10e9, network=1e9)
    node = estimate(st, lay, rates, transport="tensor", shape="node", fp8=False, elem=elem, bucket_bytes=1 << 30)
    every = estimate(st, lay, rates, transport="tensor", shape="everywhere", fp8=False, elem=elem, bucket_bytes=1 << 30)
    assert node.phase("send").seconds == pytest.approx(sum(served) / 2 / 10e9)
    assert node.phase("apply").bytes == every.phase("apply").bytes == pytest.approx(sum(served))
    assert node.phase("gather").seconds < every.phase("gather").seconds
    # FP8: each rank quantizes its own stage (gathered), not the whole model
    fp8 = node_ipc_senders(st, lay, fp8=True, elem=elem)
    assert fp8[2].quantize_in == pytest.approx((st[1].projections + st[1].experts) * elem)


def test_colocated_nccl_is_refused_and_the_colocated_flagship_plans_ipc(capsys):
    """A colocated broadcast puts a sender and a server rank of its group on one GPU, which NCCL
    refuses: validation says so; the colocated DeepSeek-V3 recipe pushes by CUDA IPC, and the plan
    shows the one-gather-per-node candidate under 5 s where every rank gathering takes ~30 s."""
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(DSV3_COLOCATED, ["sync.transport=nccl"])
    assert any(p.startswith("sync.transport: nccl refuses two ranks on one GPU") for p in err.value.problems)
    assert plan_main([DSV3_COLOCATED, "--json"]) == 0
    refit = json.loads(capsys.readouterr().out)["refit"]
    cur = refit["current"]
    assert refit["transport"] == "tensor" and cur["shape"] == "node" and refit["candidate"] is None
    note = [n for n in refit["notes"] if "everywhere gather would take" in n]
    assert len(note) == 1 and float(note[0].split("take ")[1].split(" s")[0]) > 2 * cur["seconds"]
    # what keeps the remainder: the per-tensor cost, 45,337 HF tensors + 45,032 FP8 scales by hand
    # (3 dense layers of 12 tensors, 8 quantized; 58 MoE layers of 781, 776 quantized; embedding,
    # final norm, output layer) through every server rank
    tensors = [p for p in cur["phases"] if p["name"] == "tensors"][0]
    assert tensors["link"] == "90369 tensors through each server rank"
    assert tensors["seconds"] == pytest.approx(90369 * GPU_TENSOR_OVERHEAD_S)
    assert tensors["seconds"] == max(p["seconds"] for p in cur["phases"])
    assert cur["seconds"] - tensors["seconds"] <= 5.0
    # the gather: 11 of 12 stages' served bytes cross the network, split over a node's 8 GPUs, beside
    # the node's own stage gathered over NVLink (in bf16: at most twice its FP8 served bytes)
    gather = [p for p in cur["phases"] if p["name"] == "gather"][0]
    cfg = load_config(DSV3_COLOCATED, [])
    whole = cur["payload_bytes"] / 96 * 8
    remote = whole * 11 / 12 / 8 / (cfg.cluster.network_gbps * GBPS)
    assert remote <= gather["seconds"] <= remote + 2 * whole / 12 / (cfg.cluster.nvlink_gbps * GBPS)
    # sync.colocated_gather: everywhere -- every rank gathers the model itself; node is the candidate
    assert plan_main([DSV3_COLOCATED, "sync.colocated_gather=everywhere", "--json"]) == 0
    refit = json.loads(capsys.readouterr().out)["refit"]
    cur, cand = refit["current"], refit["candidate"]
    assert cur["shape"] == "everywhere" and cand["shape"] == "node" and cand["seconds"] < cur["seconds"] / 2


def test_network_setting_is_bytes_per_second_and_plan_json_has_the_refit(capsys):
    cfg = load_config(DSV3, [])
    assert cfg.cluster.network_gbps == 50.0 and GBPS == 1e9     # 400 Gb/s per GPU = 50 GB/s
    assert plan_main([DSV3, "--json"]) == 0
    refit = json.loads(capsys.readouterr().out)["refit"]
    cur, par = refit["current"], refit["candidate"]
    assert refit["transport"] == "distributed" and refit["seconds"] == cur["seconds"]
    assert [p["name"] for p in cur["phases"]] == ["gather", "convert", "pack", "send", "apply", "buckets", "tensors"]
    assert cur["senders"] == 4 and par["senders"] == 128 and par["seconds"] < cur["seconds"]
    assert refit["slowest_link"].startswith("send: ")
    assert refit["candidate_saves_s"] == pytest.approx(cur["seconds"] - par["seconds"])
    assert refit["remainder_phase"] == "tensors"     # 90,369 served tensors through each server rank
    # half the NIC bandwidth: the network-bound send phase takes twice as long
    assert plan_main([DSV3, "cluster.network_gbps=25", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["refit"]["current"]
    send = [p["seconds"] for p in cur["phases"] if p["name"] == "send"][0]
    assert [p["seconds"] for p in slow["phases"] if p["name"] == "send"][0] == pytest.approx(2 * send)
    assert plan_main([DSV3]) == 0
    text = capsys.readouterr().out
    assert "Refit (one weight push" in text and "candidate (every EP rank sends its own experts)" in text
    assert "the candidate saves" in text and "longest phase is tensors" in text


def test_expert_senders_setting_is_the_planned_shape_and_needs_a_broadcast_with_ep(capsys):
    """``sync.expert_senders`` is what the plan models as the push (no candidate left); it is
    refused where no broadcast runs (colocated on GPU: CUDA IPC) or no expert is parallel."""
    from megarl.config import ConfigError

    assert plan_main([DSV3, "sync.expert_senders=true", "--json"]) == 0
    refit = json.loads(capsys.readouterr().out)["refit"]
    assert refit["current"]["shape"] == "expert" and refit["current"]["senders"] == 128 and refit["candidate"] is None
    for recipe, overrides, words in ((DSV3_COLOCATED, [], "a broadcast push only"),
                                     (DSV3, ["actor.parallel.ep=1"], "needs actor.parallel.ep > 1")):
        with pytest.raises(ConfigError) as err:
            load_config(recipe, ["sync.expert_senders=true", *overrides])
        assert any(p.startswith("sync.expert_senders:") and words in p for p in err.value.problems), err.value.problems


def test_colocated_gather_setting_is_validated_and_resolved():
    """``sync.colocated_gather``: node only for colocated IPC pushes and only when TP and EP x ETP
    groups fit a node (one line each); auto resolves to node for the multi-node colocated flagship
    and to everywhere on one node."""
    from megarl.config import ConfigError
    from megarl.config.validate import colocated_gather

    assert colocated_gather(load_config(DSV3_COLOCATED, [])) == "node"
    assert colocated_gather(load_config(DSV3_COLOCATED, ["sync.colocated_gather=everywhere"])) == "everywhere"
    with pytest.raises(ConfigError) as err:
        load_config(DSV3_COLOCATED, ["sync.colocated_gather=node", "cluster.gpus_per_node=4"])
    assert any(p.startswith("sync.colocated_gather: node needs every TP and expert-parallel group inside one node; "
                            "actor.parallel.tp = 8 does not divide cluster.gpus_per_node = 4") for p in err.value.problems)
    with pytest.raises(ConfigError) as err:
        load_config(DSV3_COLOCATED, ["sync.colocated_gather=node", "placement.mode=disaggregated"])
    assert any(p.startswith("sync.colocated_gather: node applies to colocated CUDA-IPC pushes")
               for p in err.value.problems)
