"""`megarl plan`: numbers equal a hand calculation, published parameter counts, refusal naming role
and shortfall, JSON output, CPU recipe fits."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.planning.cli import plan_main
from megarl.planning.memory import GIB, MIB, make_plan, weight_bytes
from megarl.planning.params import model_params, stage_layers

ROOT = Path(__file__).resolve().parent.parent
CPU_RECIPE = str(ROOT / "recipes/smollm2-135m-grpo-cpu.yaml")

# A tiny GPU recipe whose every number is worked out by hand below.
TINY = [
    "model.dtype=bfloat16", "model.recompute=none",
    "model.arch.num_layers=2", "model.arch.hidden_size=64", "model.arch.ffn_hidden_size=128",
    "model.arch.num_attention_heads=4", "model.arch.num_kv_heads=2", "model.arch.head_dim=16",
    "model.arch.vocab_size=1000", "model.arch.tie_word_embeddings=false",
    "cluster.device=cuda", "cluster.gpus_per_node=2", "cluster.nodes=1", "cluster.gpu_type=H100-80GB",
    "actor.gpus=2", "actor.optim.distributed_optimizer=true", "actor.max_tokens_per_micro_batch=100",
    "rollout.gpus=2", "rollout.tp=1", "rollout.num_servers=2", "rollout.mem_fraction=0.5",
    "rollout.max_running_requests=4", "rollout.max_prompt_len=16", "rollout.sampling.max_new_tokens=16",
    "sync.bucket_mb=1", "batch.global_batch_size=16",
]


def test_tiny_plan_equals_hand_calculation():
    cfg = load_config(CPU_RECIPE, TINY)
    plan = make_plan(cfg, "tiny")
    h, f, nh, nkv, hd, V, L = 64, 128, 4, 2, 16, 1000, 2
    # parameters: per layer q (h*nh*hd) + k,v (2*h*nkv*hd) + o (nh*hd*h) + SwiGLU 3*h*f + 2 norms
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h          # 4096 + 4096 + 4096
    layer = attn + 3 * h * f + 2 * h                               # 12288 + 24576 + 128 = 36992
    total = V * h + V * h + h + L * layer                           # embedding + output + final norm
    assert total == 202048
    assert plan.total_params == total
    a = plan.roles["actor"]
    assert a.params_on_gpu == total                                # tp1 pp1: everything on one GPU
    assert a.params == 2 * total                                   # bf16
    assert a.grads == 4 * total                                    # fp32 main grads
    assert a.optimizer == int(total * 12 / 2)                      # fp32 master + Adam m, v over dp = 2
    # activations (Korthikanti-style bookkeeping for SwiGLU/GQA/flash, 2-byte values), 100 tokens:
    # 8h (norm/qkv/mlp inputs) + 4*nh*hd + 4*nkv*hd (Q,K,V,O) + 6f (SwiGLU) bytes per token and layer
    per_token_layer = 8 * h + 4 * nh * hd + 4 * nkv * hd + 6 * f   # 512 + 256 + 128 + 768 = 1664
    assert a.activations == 100 * L * per_token_layer               # 332800
    assert a.logits == 100 * V * 10                                 # bf16 logits + fp32 log-softmax + fp32 grad
    # rollout: bf16 weights / tp, KV = 2 (K,V) * layers * kv_heads * head_dim * 2 bytes per token
    ro = plan.rollout
    assert ro.weights == 2 * total
    assert ro.kv_per_token == 2 * L * nkv * hd * 2 == 256
    assert ro.kv_needed == 4 * (16 + 16) * 256
    gpu = 81559 * MIB
    assert ro.reserved == int(0.5 * gpu)
    assert ro.kv_available == int(0.5 * gpu) - 2 * total
    # sync: two buckets of max(1 MiB, largest tensor = the 1000 x 64 embedding in bf16 = 128000 B)
    assert plan.sync_buckets == 2 * MIB
    phases = {p.name: p for p in plan.phases}
    state = 2 * total + 4 * total + int(total * 6)
    assert phases["train:actor"].total == 2 * GIB + state + 332800 + 1_000_000   # 2 processes x 1 GiB
    assert phases["rollout"].total == 2 * GIB + state + int(0.5 * gpu) + 2 * GIB
    assert plan.fits and plan.nodes_needed == 1



def test_forward_budget_plans_forward_passes_by_hand():
    """``forward_max_tokens_per_micro_batch``: the driver plans forward passes with it (training
    keeps ``max_tokens_per_micro_batch``), and the plan counts one layer's activations plus the
    logits of that many tokens, for the frozen reference and for the actor's forward pass when that
    is larger than its training step."""
    from megarl.config import validate_config
    from megarl.config.loader import ConfigError
    from megarl.workers.group import token_budget

    h, f, nh, nkv, hd, V, L = 64, 128, 4, 2, 16, 1000, 2
    one_layer = 8 * h + 4 * nh * hd + 4 * nkv * hd + 6 * f          # bytes per token, as above
    base = make_plan(load_config(CPU_RECIPE, TINY + ["ref.enabled=true", "ref.gpus=2",
                                                      "ref.max_tokens_per_micro_batch=100"]))
    assert base.roles["ref"].activations == 100 * one_layer and base.roles["ref"].logits == 100 * V * 6
    cfg = load_config(CPU_RECIPE, TINY + ["ref.enabled=true", "ref.gpus=2",
                                          "ref.max_tokens_per_micro_batch=100",
                                          "ref.forward_max_tokens_per_micro_batch=400",
                                          "actor.forward_max_tokens_per_micro_batch=2000"])
    assert token_budget(cfg, "actor") == 100 and token_budget(cfg, "actor", forward_only=True) == 2000
    assert token_budget(cfg, "ref", forward_only=True) == 400
    # the driver's plans: WorkerGroup.forward's micro-batches hold up to 2000 tokens, train's 100
    from megarl.data.batch import TokenBatch
    from megarl.workers.group import WorkerGroup

    group = WorkerGroup.__new__(WorkerGroup)     # the planning half only: no ranks started
    group.role, group.cfg, group.role_cfg = "actor", cfg, cfg.actor
    group._topology = [{"dp": 1, "dp_rank": 0}]
    batch = TokenBatch.from_sequences([[1] * 10] * 40, [[2] * 20] * 40)   # 40 samples of 30 tokens
    assert group.plan(batch, forward_only=True).micro_sizes[0] == [[40]]          # 1200 tokens <= 2000
    train = group.plan(batch).micro_sizes[0][0]
    assert sum(train) == 40 and max(train) == 3 and len(train) == 14            # 3 x 30 <= 100
    plan = make_plan(cfg)
    ref, actor = plan.roles["ref"], plan.roles["actor"]
    assert ref.activations == 400 * one_layer and ref.logits == 400 * V * 6
    # actor: training 100 * (L * 1664 + 10 V) = 1.33 MB < forward 2000 * (1664 + 6 V) = 15.3 MB
    assert actor.activations == 2000 * one_layer and actor.logits == 2000 * V * 6
    assert any("2000 tokens per forward-only micro-batch (the peak" in n for n in actor.notes)
    # without a forward budget nothing changes, also where the forward estimate would count the
    # gathered K/V that training under full recompute does not (context parallel); a forward budget
    # below training's (16 tokens per CP rank: the longest sample) cannot set the peak, so that
    # plan's activations are the training estimate
    cp = TINY + ["critic.enabled=true", "critic.gpus=2", "critic.parallel.cp=2", "critic.max_tokens_per_micro_batch=100",
                 "model.recompute=full", "algorithm.advantage=gae"]
    same = make_plan(load_config(CPU_RECIPE, cp)).roles["critic"]
    small = make_plan(load_config(CPU_RECIPE, cp + ["critic.forward_max_tokens_per_micro_batch=16"])).roles["critic"]
    assert (same.activations, same.logits) == (small.activations, small.logits)
    assert not any("forward-only" in n for n in same.notes)
    # a role that only runs forward passes reports the K/V exchange of its forward micro-batch:
    # 2 (cp - 1) tokens x K/V width x bytes, four times as much for 400 tokens as for 100
    ref_cp = TINY + ["ref.enabled=true", "ref.gpus=2", "ref.parallel.cp=2", "ref.max_tokens_per_micro_batch=100"]
    train_sized = make_plan(load_config(CPU_RECIPE, ref_cp)).roles["ref"]
    fwd_sized = make_plan(load_config(CPU_RECIPE, ref_cp + ["ref.forward_max_tokens_per_micro_batch=400"])).roles["ref"]
    assert train_sized.cp_kv_bytes_per_layer == 2 * 1 * 100 * nkv * hd * weight_bytes(cfg.model.dtype)
    assert fwd_sized.cp_kv_bytes_per_layer == 4 * train_sized.cp_kv_bytes_per_layer
    assert fwd_sized.cp_kv_seconds_per_layer == pytest.approx(4 * train_sized.cp_kv_seconds_per_layer)
    # forward only: the all-gather alone (a trained role's figure counts the backward's reduce-scatter too)
    assert train_sized.cp_kv_seconds_per_layer == pytest.approx(train_sized.cp_kv_bytes_per_layer / 300e9)
    assert not any("backward" in n for n in fwd_sized.notes if n.startswith("cp2"))
    with pytest.raises(ConfigError, match="actor.forward_max_tokens_per_micro_batch"):
        validate_config(load_config(CPU_RECIPE, TINY + ["actor.forward_max_tokens_per_micro_batch=-1"]))

def test_tp_pp_sharding_by_hand():
    """tp2 pp2 with uneven last stage: embedding on stage 0, output on the last, layers split."""
    over = TINY + ["model.arch.num_layers=5", "actor.gpus=4", "rollout.gpus=4", "rollout.num_servers=4",
                   "cluster.gpus_per_node=4", "actor.parallel.tp=2", "actor.parallel.pp=2",
                   "actor.parallel.last_stage_layers=2", "batch.global_batch_size=8"]
    cfg = load_config(CPU_RECIPE, over)
    assert [len(r) for r in stage_layers(5, cfg.actor.parallel)] == [3, 2]
    plan = make_plan(cfg)
    h, V = 64, 1000
    sharded_layer = (12288 + 24576) // 2 + 2 * h                   # attention + MLP over tp, norms replicated
    stage0 = 3 * sharded_layer + V * h // 2
    stage1 = 2 * sharded_layer + V * h // 2 + h
    a = plan.roles["actor"]
    assert a.params_on_gpu == (stage0 if a.stage == 0 else stage1)
    assert {a.stage: a.params_on_gpu} in ({0: stage0}, {1: stage1})


def test_published_parameter_counts():
    """Totals against the model cards (DeepSeek-V3 671B without the 14B MTP module, Qwen3-235B-A22B,
    Qwen3-30B-A3B 30.5B / 3.3B active, Llama-3.1-8B 8.03B, Qwen2.5-0.5B 0.49B, SmolLM2-135M)."""
    published = {"deepseek-v3-671b-grpo": (671e9, 37e9), "qwen3-235b-a22b-dapo": (235e9, 22e9),
                 "qwen3-30b-a3b-grpo": (30.5e9, 3.3e9), "llama3.1-8b-ppo": (8.03e9, 8.03e9),
                 "qwen2.5-0.5b-grpo": (0.494e9, 0.494e9), "qwen3-8b-dapo": (8.2e9, 8.2e9),
                 "smollm2-135m-grpo-cpu": (134.5e6, 134.5e6)}
    for name, (total, active) in published.items():
        arch = load_config(str(ROOT / f"recipes/{name}.yaml")).model.arch
        mp = model_params(arch)
        assert abs(mp.total - total) / total < 0.015, (name, mp.total)
        assert abs(mp.active(arch) - active) / active < 0.05, (name, mp.active(arch))


def test_cpu_recipe_fits_and_json(capsys):
    assert plan_main([CPU_RECIPE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True and out["cpu"] is True
    assert out["roles"]["actor"]["params"] == out["total_params"] * 4      # fp32 on CPU
    assert out["pools"]["host"]["headroom"] > 0


def test_refuses_recipe_that_cannot_fit_naming_role_and_shortfall():
    """Qwen3-235B colocated on 64 H100s without offload: the actor's training phase does not fit."""
    recipe = str(ROOT / "recipes/qwen3-235b-a22b-dapo.yaml")
    over = ["cluster.gpu_type=H100-80GB", "actor.offload.params=false", "actor.offload.grads=false", "actor.offload.optimizer=false", "placement.mode=colocated", "actor.gpus=64",
            "rollout.gpus=64", "rollout.num_servers=8", "rollout.mem_fraction=0.6", "sync.transport=ipc"]
    proc = subprocess.run([sys.executable, "-m", "megarl", "plan", recipe, *over, "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["fits"] is False
    peak = plan["pools"]["gpu"]
    short = (peak["total"] - peak["capacity"]) / GIB
    assert short > 0
    m = re.search(r"(\w+): phase '([^']+)' needs ([\d.]+) GiB per GPU, one H100-80GB has ([\d.]+) GiB: short by ([\d.]+) GiB",
                  proc.stderr)
    assert m, proc.stderr
    assert m.group(1) in plan["roles"] or m.group(1) in ("rollout", "sync")
    assert float(m.group(5)) == pytest.approx(short, abs=0.051)
    # the readable table says the same and suggests a way out
    proc = subprocess.run([sys.executable, "-m", "megarl", "plan", recipe, *over], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1 and "DOES NOT FIT" in proc.stdout and "suggestion:" in proc.stdout


def test_too_few_nodes_is_refused():
    cfg = load_config(str(ROOT / "recipes/deepseek-v3-671b-grpo.yaml"), [])
    cfg.cluster.nodes = 16                 # trainer 16 nodes + rollout 8 nodes do not fit in 16
    plan = make_plan(cfg)
    assert not plan.fits and plan.nodes_needed == 24
    assert any(p.startswith("cluster.nodes:") and "short by 8 node(s)" in p for p in plan.problems)


def test_unknown_gpu_is_a_config_error(capsys):
    from megarl.cli import main

    assert main(["plan", CPU_RECIPE, "cluster.gpu_type=Z100-1GB"]) == 2   # one line via the CLI's error path
    err = capsys.readouterr().err
    assert "cluster.gpu_type: unknown GPU 'Z100-1GB'" in err and "H100-80GB" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("recipe", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_every_recipe_fits_its_gpus(recipe):
    out = subprocess.run([sys.executable, "-m", "megarl", "plan", str(recipe), "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


# ----------------------------------------------------------------------------- offload
SEVEN_B = str(ROOT / "recipes/qwen2.5-7b-grpo-1gpu.yaml")
NO_OFFLOAD = ["actor.offload.params=false", "actor.offload.grads=false", "actor.offload.optimizer=false",
              "actor.optim.cpu_offload_fraction=0"]


def test_7b_on_one_h200_is_refused_without_offload_and_the_verdict_names_the_switch():
    """Full-parameter 7B on one H200: bf16 params 2 B + fp32 grads 4 B + fp32 master and Adam 12 B
    per parameter = 18 B x 7.6B = 127.7 GiB before activations; the plan refuses it and names the
    switches that make it fit, and that combination's own plan fits."""
    plan = make_plan(load_config(SEVEN_B, NO_OFFLOAD), SEVEN_B)
    a = plan.roles["actor"]
    assert a.static == pytest.approx(18 * a.params_on_gpu, rel=1e-6)
    assert not plan.fits
    assert any(p.startswith("actor: phase 'train:actor'") and "short by" in p for p in plan.problems)
    named = [s for s in plan.suggestions if s.startswith("offload: fits with ")]
    assert named, plan.suggestions
    switches = named[0][len("offload: fits with "):].split()
    assert make_plan(load_config(SEVEN_B, NO_OFFLOAD + switches), SEVEN_B).fits


def test_offload_moves_state_from_gpu_phases_to_host_memory():
    """Each switch takes its bytes out of the phases other than the role's own pass and puts the
    copied ones (params, optimizer; not grads) into the host column; the CPU optimizer moves its
    fraction of the Adam moments (with an fp32 copy of their main params and a pinned fp32 grad
    copy) to the host for good, the fp32 main params staying on the GPU (measured on the H200)."""
    base = make_plan(load_config(SEVEN_B, NO_OFFLOAD), SEVEN_B)
    on = make_plan(load_config(SEVEN_B, NO_OFFLOAD[3:] + ["actor.offload.params=true", "actor.offload.grads=true",
                                                          "actor.offload.optimizer=true"]), SEVEN_B)
    a = base.roles["actor"]
    rollout = {p.name: p for p in on.phases}["rollout"]
    assert "actor resident" not in rollout.parts                     # nothing of the actor stays
    assert {p.name: p for p in base.phases}["rollout"].parts["actor resident"] == a.static
    host = on.host["actor offloaded (params+optimizer)"]
    assert host == a.params + a.optimizer                            # grads are released, not copied
    assert on.offload_seconds == pytest.approx(host / 55e9)
    half = make_plan(load_config(SEVEN_B, NO_OFFLOAD[:3] + ["actor.optim.cpu_offload_fraction=0.5"]), SEVEN_B)
    h = half.roles["actor"]
    n = a.params_on_gpu            # megatron's hybrid optimizer: fp32 main params stay on the GPU (4 B),
    assert h.optimizer == pytest.approx(n * (4 + 8 * 0.5), abs=2)                 # half the Adam moments too;
    assert h.host_optimizer == pytest.approx(0.5 * n * (4 + 8 + 4), abs=2)        # the rest + grads on the host


def test_host_memory_of_a_node_is_checked():
    plan = make_plan(load_config(SEVEN_B, ["cluster.host_memory_gb=48"]), SEVEN_B)
    assert not plan.fits
    (problem,) = [p for p in plan.problems if p.startswith("host:")]
    assert "the node has 48.0 GiB (cluster.host_memory_gb)" in problem and "short by" in problem
    assert "host memory per node" in subprocess.run(
        [sys.executable, "-m", "megarl", "plan", SEVEN_B], capture_output=True, text=True, cwd=ROOT).stdout.lower()


def test_train_switches_on_what_the_plan_needs_and_says_so():
    """Switches left null: `megarl train` turns on the cheapest combination that fits a colocated
    GPU layout (one line), and leaves CPU runs and explicit settings alone."""
    from megarl.planning.offload import resolve_offload

    cfg = load_config(SEVEN_B, ["actor.offload.params=null", "actor.offload.grads=null",
                                "actor.offload.optimizer=null", "actor.optim.cpu_offload_fraction=0"])
    line = resolve_offload(cfg, lambda c: make_plan(c, SEVEN_B, suggest=False))
    assert line is not None and line.startswith("offload: the colocated layout needs it, switched on ")
    assert make_plan(cfg, SEVEN_B).fits
    assert all(getattr(cfg.actor.offload, k) is not None for k in ("params", "grads", "optimizer"))
    small = str(ROOT / "recipes/qwen2.5-0.5b-grpo.yaml")     # colocated on one GPU, fits as it is
    fits_already = load_config(small)
    assert resolve_offload(fits_already, lambda c: make_plan(c, small, suggest=False)) is None
    assert not any(getattr(getattr(fits_already, r).offload, k) for r in ("actor", "ref")
                   for k in ("params", "grads", "optimizer"))
    explicit = load_config(SEVEN_B)                          # the recipe says what it wants: kept
    assert resolve_offload(explicit, lambda c: make_plan(c, SEVEN_B, suggest=False)) is None
    assert (explicit.actor.offload.params, explicit.actor.offload.grads, explicit.actor.offload.optimizer) == (
        True, True, False)
    cpu = load_config(CPU_RECIPE)
    assert resolve_offload(cpu, lambda c: make_plan(c, CPU_RECIPE, suggest=False)) is None
    assert (cpu.actor.offload.params, cpu.actor.offload.grads, cpu.actor.offload.optimizer) == (False, False, False)


def test_released_server_weights_are_on_the_host_only_where_the_servers_keep_them():
    """Rollout servers drop released weights (SGLang's default, the embedded engine alike) unless they
    run with --enable-weights-cpu-backup; the host plan counts them exactly when the launcher asks."""
    line = "rollout weights (released, host copy)"
    dropped = make_plan(load_config(SEVEN_B, []), SEVEN_B)      # every release followed by a full push
    assert line not in dropped.host
    kept = make_plan(load_config(SEVEN_B, ["reward.kind=model", "reward_model.enabled=true"]), SEVEN_B)
    assert kept.host[line] == kept.rollout.weights            # one GPU: one server's weights
