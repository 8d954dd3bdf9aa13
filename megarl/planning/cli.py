"""``megarl plan RECIPE [overrides...]``: memory per role and GPU before launch; exit 1 if it does not fit."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from megarl.config import load_config
from megarl.planning.memory import GIB, Plan, make_plan
from megarl.planning.refit import RefitPlan


def _g(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(plan: Plan) -> str:
    lines = []
    dev = "host (CPU run)" if plan.cpu else plan.gpu_type
    lines.append(f"megarl plan: {plan.recipe}")
    lines.append(f"  model: {plan.total_params / 1e9:.3f}B parameters ({plan.active_params / 1e9:.3f}B active per token)")
    lines.append(f"  device: {dev}, {plan.device_bytes / GIB:.1f} GiB; placement {plan.placement}; "
                 f"nodes needed {plan.nodes_needed} (recipe: {plan.nodes} x {plan.gpus_per_node} GPUs)")
    lines.append("")
    per = "per rank" if plan.cpu else "per GPU"
    lines.append(f"  Megatron roles, GiB {per} (largest pipeline stage):")
    lines.append(f"    {'role':<13}{'layout':<30}{'params':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'logits':>8} "
                 f"{'peak':>8} {'host':>8}   offload")
    for r in plan.roles.values():
        lines.append(f"    {r.role:<13}{r.layout:<30}{_g(r.params)} {_g(r.grads)} {_g(r.optimizer)} "
                     f"{_g(r.activations)} {_g(r.logits)} {_g(r.peak)} {_g(r.host_pinned + r.host_optimizer)}   "
                     f"{'+'.join(r.offload) or '-'}")
        for note in r.notes:
            lines.append(f"    {'':<13}stage {r.stage}, {r.params_on_gpu / 1e9:.3f}B params on it; {note}")
    ro = plan.rollout
    lines.append("")
    lines.append(f"  Rollout: {ro.servers} server(s) x tp{ro.tp}: weights ({ro.weight_format}) {ro.weights / GIB:.2f} GiB/GPU, "
                 f"KV {ro.kv_per_token / 1024:.1f} KiB/token/GPU, needed {ro.kv_needed / GIB:.2f} GiB "
                 f"(max_running_requests x {ro.seq_len} tokens), available {ro.kv_available / GIB:.2f} GiB "
                 f"-> {ro.concurrent_at_full_length} full-length sequences")
    lines.append(f"  Weight sync: {plan.sync_buckets / GIB:.2f} GiB of buckets per side (2 x max(bucket, largest tensor))")
    lines.extend(format_refit(plan.refit))
    lines.append("")
    lines.append(f"  Phases, GiB {per if not plan.cpu else 'on the host'}:")
    for ph in plan.phases:
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in ph.parts.items() if v)
        lines.append(f"    [{ph.pool}] {ph.name:<20}{_g(ph.total)}   = {parts}")
    lines.append("")
    if plan.host:
        parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in plan.host.items() if v)
        lines.append(f"  Host memory per node: {plan.host_total / GIB:.1f} GiB of {plan.host_capacity / GIB:.1f} GiB = {parts}")
        if plan.offload_seconds:
            lines.append(f"  Offload per step: {plan.offload_seconds:.2f} s out and {plan.offload_seconds:.2f} s back per GPU "
                         f"(pinned bytes / cluster.host_bandwidth_gbps)")
        lines.append("")
    for pool, v in plan.pool_peaks().items():
        ok = "fits" if v["headroom"] >= 0 else "DOES NOT FIT"
        lines.append(f"  {pool} pool peak: {v['total'] / GIB:.1f} GiB in '{v['phase']}' of {v['capacity'] / GIB:.1f} GiB "
                     f"-> {ok} (headroom {v['headroom'] / GIB:+.1f} GiB)")
    for w in plan.warnings:
        lines.append(f"  warning: {w}")
    if plan.fits:
        lines.append("  verdict: FITS")
    else:
        lines.append("  verdict: DOES NOT FIT")
        for p in plan.problems:
            lines.append(f"    - {p}")
        for s in plan.suggestions:
            lines.append(f"    suggestion: {s}")
    return "\n".join(lines) + "\n"


def format_refit(refit: Optional[RefitPlan]) -> list[str]:
    """The refit lines: seconds per phase of the configured push and of the candidate shape, the
    slowest link, the model's caveats."""
    if refit is None:
        return []
    out = [f"  Refit (one weight push, {refit.transport}; model: planning/refit.py, cluster.nvlink_gbps / network_gbps):"]
    for label, est in (("now", refit.current), ("candidate", refit.candidate)):
        if est is None:
            continue
        parts = ", ".join(f"{p.name} {p.seconds:.3f}" for p in est.phases)
        out.append(f"    {label} ({est.label}): {est.seconds:.2f} s with {est.senders} sender(s), "
                   f"{est.payload_bytes / 1e9:.1f} GB packed "
                   f"= {parts}; slowest link {est.slowest_link} ({est.slowest_link_seconds:.2f} s)")
    cut = refit.cut()
    if cut:
        saves, rest = cut
        out.append(f"    the candidate saves {saves:.2f} s; its longest phase is {rest.name} ({rest.seconds:.2f} s, {rest.link})")
    for n in refit.notes:
        out.append(f"    note: {n}")
    return out


def plan_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="megarl plan",
        description="Estimate memory per role and GPU (params, grads, optimizer, activations, rollout KV cache, "
                    "weight-sync buckets) and say whether the recipe fits its GPUs. Exit 1 when it does not.")
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.parallel.tp=8")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory of one GPU, for GPU types not in the table")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, args.overrides)      # a ConfigError is printed in one line by megarl.cli
    override = int(args.gpu_memory_gib * GIB) if args.gpu_memory_gib else None
    plan = make_plan(cfg, args.recipe, override)
    if args.json:
        json.dump(plan.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_plan(plan))
    if not plan.fits:
        print("megarl plan: does not fit:\n  " + "\n  ".join(plan.problems), file=sys.stderr)
        return 1
    return 0
