"""The refit model (megarl/planning/refit.py) against real pushes across two fake nodes (one JSON line).

    sudo python benchmarks/bench_refit_model.py [--layouts tp1,tp2,pp2,ep2,ep2x,tp2pp2ep2] [--reps 3]

Node 0 (a network namespace, tests/netns_cluster.py) runs four Megatron ranks on gloo; node 1 runs
an embedded server (TP1). Each layout pushes the same small Qwen3-MoE through megarl's own path
(``push_megatron``: one sender per pipeline stage, TP all-gathers and expert transfers to it, a
gloo broadcast over the veth, the server's verify and apply; ``ep2x``: each EP rank sends its own
experts through its own update group) and is timed on rank 0 from a barrier
before to a barrier after (best of ``--reps`` after a warm-up push).

The model is not given this machine's speed: every rate it uses is measured in the same run,
before the pushes, by a plain operation -- the veth (a gloo broadcast from node 0 to a process on
node 1), the in-node link (gloo sends of quarter-bucket units in every pair of node 0's ranks at
once, as a layout's groups transfer together), a copy, the checksum, the server's verify
(checksum + fp32 sum of the bytes), an HTTP round trip to the server. So a
prediction off by much is a wrong structure (phases, bytes, which link the senders share), not a
slow machine. Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name: (tp, pp, ep, expert senders); "x": every EP rank sends its own experts (the model's candidate)
LAYOUTS = {"tp1": (1, 1, 1, False), "tp2": (2, 1, 1, False), "pp2": (1, 2, 1, False), "ep2": (1, 1, 2, False),
           "ep2x": (1, 1, 2, True), "tp2pp2ep2": (2, 2, 2, False)}
MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2,
             tie_word_embeddings=False)
LINK_PORT = 29517          # inside a fresh namespace: nothing else binds it
PROBE_BYTES = 64 << 20
BUCKET_MB = 16


def _best(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ----------------------------------------------------------------------------- node 1: link peer
def peer(master: str, reps: int) -> None:
    """Rank 1 of the link probe: receive the broadcasts node 0 times."""
    import torch
    import torch.distributed as dist

    from megarl.wire.process_group import bind_gloo_towards

    bind_gloo_towards(master)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{LINK_PORT}", rank=1, world_size=2)
    buf = torch.empty(PROBE_BYTES, dtype=torch.uint8)
    for _ in range(reps + 1):
        dist.broadcast(buf, src=0)
        dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- node 0
def _link_rate(master: str, reps: int) -> float:
    import torch
    import torch.distributed as dist

    from megarl.wire.process_group import bind_gloo_towards

    bind_gloo_towards(master)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{LINK_PORT}", rank=0, world_size=2)
    buf = torch.ones(PROBE_BYTES, dtype=torch.uint8)

    def once() -> None:
        dist.broadcast(buf, src=0)
        dist.barrier()

    s = _best(once, reps)
    dist.destroy_process_group()
    return PROBE_BYTES / s


def _local_rates(reps: int) -> dict[str, float]:
    """Copy (pack, server write), checksum (sender), verify (server: checksum + fp32 sum), one thread."""
    import torch

    from megarl.wire.checksum import checksum

    torch.set_num_threads(1)
    src = torch.randn(PROBE_BYTES // 4)
    dst = torch.empty_like(src)
    copy = PROBE_BYTES / _best(lambda: dst.copy_(src), reps)
    ck = PROBE_BYTES / _best(lambda: checksum(src), reps)
    verify = PROBE_BYTES / _best(lambda: (checksum(src), src.sum(dtype=torch.float32).item()), reps)
    return {"copy": copy, "checksum": ck, "verify": verify}


def _http_round_trip(url: str, reps: int = 20) -> float:
    import urllib.request

    def once() -> None:
        urllib.request.urlopen(url + "/health", timeout=30).read()

    return _best(once, reps)


def _ranks(rank: int, world: int, hf_dir: str, url: str, layouts: list[str], reps: int) -> dict[str, Any]:
    """Every layout on the same four processes: the in-node link once, then each layout's pushes."""
    import contextlib

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig

    from megarl.models import build_model, load_hf_weights
    from megarl.parallel import apply_cpu_shim, init_model_parallel
    from megarl.sync.push import WeightPusher, is_sender_rank, push_megatron, sender_group_name
    from megarl.sync.session import weight_update_session

    torch.set_num_threads(1)
    apply_cpu_shim()
    out: dict[str, Any] = {}
    # the in-node link as the stage stream uses it: transfer units of a quarter bucket, rank 2i -> 2i+1
    # for every pair at once (a layout's groups transfer together; on CPU they share the node's cores)
    unit = torch.ones((BUCKET_MB << 20) // 4, dtype=torch.uint8)
    units = PROBE_BYTES // unit.numel()

    def pair() -> None:
        for _ in range(units):
            if rank % 2 == 0:
                dist.send(unit, rank + 1)
            else:
                dist.recv(unit, rank - 1)
        dist.barrier()

    out["in_node"] = PROBE_BYTES / _best(pair, reps)            # bytes each receiving rank takes per second
    cfg = AutoConfig.from_pretrained(hf_dir)
    for name in layouts:
        tp, pp, ep, experts = LAYOUTS[name]
        init_model_parallel(tp=tp, pp=pp, ep=ep, etp=1)
        chunks = build_model(cfg)
        load_hf_weights(chunks, hf_dir)
        pusher = None
        if is_sender_rank(expert_senders=experts):
            pusher = WeightPusher([url], transport="distributed", backend="gloo", bucket_mb=BUCKET_MB,
                                  group_name=sender_group_name(f"bench_{name}", expert_senders=experts))
            pusher.connect()
        seconds, cpu, stats = [], [], None
        for i in range(reps + 1):
            with weight_update_session([url]) if rank == 0 else contextlib.nullcontext():
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                st = push_megatron(chunks, cfg, pusher, weight_version=f"{name}-{i}", bucket_mb=BUCKET_MB,
                                   expert_senders=experts)
                c1 = time.process_time()
                dist.barrier()
                seconds.append(time.perf_counter() - t0)
                cpu.append(c1 - c0)
            stats = st.as_dict() if pusher is not None else None
        if pusher is not None:
            pusher.close()
        sent, cpus = [None] * world, [None] * world
        dist.all_gather_object(sent, stats)
        dist.all_gather_object(cpus, cpu)
        best = min(range(1, reps + 1), key=lambda k: seconds[k])
        out[name] = {"seconds": min(seconds[1:]), "all_seconds": seconds,
                     "senders": [s for s in sent if s], "bytes": sum(s["bytes"] for s in sent if s),
                     "ranks_cpu_s": sum(c[best] for c in cpus)}
        del chunks
    return out


def inner(args: dict[str, Any]) -> None:
    from megarl.parallel import spawn

    reps = args["reps"]
    link = _link_rate(args["node0"], reps)
    local = _local_rates(reps)
    rtt = _http_round_trip(args["url"])
    ranks = spawn(_ranks, 4, args["hf_dir"], args["url"], args["layouts"], reps, timeout_s=1800)
    print(json.dumps({"link": link, "local": local, "rtt": rtt, "ranks": ranks[0]}), flush=True)


# ----------------------------------------------------------------------------- root: nodes, model, report
def predict(hf_dir: str, measured: dict[str, Any], name: str) -> dict[str, Any]:
    from megarl.config.schema import ModelArch, ParallelConfig
    from megarl.config.validate import arch_from_hf
    from megarl.planning.params import stage_layers
    from megarl.planning.refit import Layout, Rates, estimate, stage_bytes

    hf = json.load(open(os.path.join(hf_dir, "config.json")))
    arch = ModelArch(**arch_from_hf(hf))
    tp, pp, ep, experts = LAYOUTS[name]
    stages = stage_bytes(arch, stage_layers(arch.num_layers, ParallelConfig(tp=tp, pp=pp, ep=ep)))
    lay = Layout(tp=tp, pp=pp, ep=ep, etp=1, world=4, ranks_per_node=4, server_tp=1, servers=1,
                 server_first_node=1, server_ranks_per_node=1)
    loc = measured["local"]
    rates = Rates(nvlink=measured["ranks"]["in_node"], network=measured["link"], nics_per_node=1, pack=loc["copy"], convert=loc["copy"],
                  quantize=0.0, checksum=loc["checksum"], verify=loc["verify"], write=loc["copy"], ipc_receive=0.0,
                  bucket_overhead_s=measured["rtt"])
    kw = dict(transport="distributed", fp8=False, elem=4, bucket_bytes=BUCKET_MB << 20)
    est = estimate(stages, lay, rates, shape="expert" if experts else "stage", **kw)
    cand = estimate(stages, lay, rates, shape="expert", **kw) if ep > 1 else est
    got = measured["ranks"][name]
    return {"layout": name, "senders": est.senders, "predicted_s": round(est.seconds, 4),
            "measured_s": round(got["seconds"], 4), "ratio": round(est.seconds / got["seconds"], 3),
            "predicted_bytes": int(est.payload_bytes), "measured_bytes": got["bytes"],
            "phases": {p.name: round(p.seconds, 4) for p in est.phases}, "slowest_link": est.slowest_link,
            "candidate_expert_senders_s": round(cand.seconds, 4),
            "all_measured_s": [round(x, 4) for x in got["all_seconds"]],
            "trainer_cpu_s_per_wall_s": round(got["ranks_cpu_s"] / got["seconds"], 2),
            "sender_breakdown": [{k: round(s[k], 4) for k in ("seconds", "pack_s", "checksum_s", "send_s")}
                                 for s in got["senders"]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peer:
        peer(a.peer, a.reps)
        return 0
    if a.inner:
        inner(json.loads(a.inner))
        return 0
    from tests.helpers.servers import make_tiny_hf_model
    from tests.netns_cluster import NetnsCluster, netns_available

    why = netns_available()
    if why:
        print(json.dumps({"bench": "refit_model", "skipped": why}))
        return 1
    d = tempfile.mkdtemp(prefix="megarl_refit_")
    hf_dir = os.path.join(d, "moe")
    make_tiny_hf_model(hf_dir, "qwen3_moe", std=0.02, **MODEL)
    layouts = a.layouts.split(",")
    with NetnsCluster(2) as box:
        n0, n1 = box.address(0), box.address(1)
        url = f"http://{n1}:30000"
        log = open(os.path.join(d, "server.log"), "w")
        box.popen(1, [sys.executable, "-m", "megarl.engine", hf_dir, "--host", n1, "--port", "30000",
                      "--num-threads", "1"], stdout=log, stderr=log)
        box.popen(1, [sys.executable, os.path.abspath(__file__), "--peer", n0, "--reps", str(a.reps)])
        wait = ("import time,urllib.request\nfor _ in range(600):\n try:\n  urllib.request.urlopen("
                f"'{url}/health',timeout=5).read(); break\n except Exception: time.sleep(0.5)\nprint('{{}}')")
        box.python(0, wait, timeout=400)
        args = {"node0": n0, "url": url, "hf_dir": hf_dir, "layouts": layouts, "reps": a.reps}
        proc = box.run(0, [sys.executable, os.path.abspath(__file__), "--inner", json.dumps(args)], timeout=3000)
        measured = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [predict(hf_dir, measured, n) for n in layouts]
    print(json.dumps({"bench": "refit_model", "date": time.strftime("%Y-%m-%d"), "model": MODEL, "bucket_mb": BUCKET_MB,
                      "rates_bytes_per_s": {"veth_gloo": round(measured["link"]), "in_node_gloo": round(measured["ranks"]["in_node"]),
                                            **{k: round(v) for k, v in measured["local"].items()}},
                      "http_round_trip_s": round(measured["rtt"], 5), "layouts": rows,
                      "max_abs_error": round(max(abs(r["ratio"] - 1) for r in rows), 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
