"""CPU time the rollout client spends in the trainer's process per step of single-sample requests.

The off-policy sources (one_step_off, async) ask for each sample on its own. Every request costs
Python time on the client's HTTP thread, and that thread shares the interpreter lock with the
trainer's main thread, which launches the kernels of the phases running beside the rollout. This
benchmark sends one step's samples (``--prompts`` groups of ``--n``) to a real embedded server as
the sources do -- one ``generate_one`` per sample, each with its own seed -- once one request per
sample (``rollout.coalesce_max_samples=1``, the baseline) and once coalesced per group (the
default), and reports the HTTP thread's CPU seconds of each (from /proc, so the server's own work
is not counted) and their ratio. It also checks that both return the same tokens.

    python benchmarks/bench_client_cpu.py --prompts 64 --n 8 --new-tokens 40
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def thread_cpu_s(native_id: int) -> float:
    """User + system CPU seconds of one thread of this process."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_step(manager, prompts: list[list[int]], n: int, sampling: dict) -> tuple[list, float, float]:
    """All samples of a step as the off-policy sources send them: (outputs, wall s, HTTP-thread CPU s)."""
    async def step():
        return await asyncio.gather(*(
            manager.generate_one(p, dict(sampling, n=1, sampling_seed=1000 + j * n + k), job_index=j * n + k,
                                 batch_key=("group", j))
            for j, p in enumerate(prompts) for k in range(n)))
    tid = manager.io._t.native_id
    cpu, wall = thread_cpu_s(tid), time.perf_counter()
    outs = manager.io.run(step())
    return outs, time.perf_counter() - wall, thread_cpu_s(tid) - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2, help="steps per setting (the least CPU is reported)")
    args = ap.parse_args()

    from megarl.rollout.manager import RolloutManager
    from tests.helpers.models import make_tiny_chat_model
    from tests.helpers.servers import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="megarl_bench_client_"))
    model = make_tiny_chat_model(work / "tiny")
    samples = args.prompts * args.n
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    prompts = [[1, 2, 3, 4 + i] * 8 for i in range(args.prompts)]
    result = {"bench": "client_cpu", "samples": samples, "new_tokens": args.new_tokens}
    tokens = {}
    with ServerProcess(str(model)) as server:
        for name, coalesce in (("per_sample", 1), ("per_group", 64)):
            manager = RolloutManager([server.url], max_concurrency=samples, coalesce_max_samples=coalesce)
            try:
                one_step(manager, prompts[:2], args.n, sampling)   # warm-up: connections, server graphs
                sent = manager.requests
                runs = [one_step(manager, prompts, args.n, sampling) for _ in range(args.repeats)]
                best = min(runs, key=lambda r: r[2])
                tokens[name] = [o.output_ids for o in best[0]]
                result[name] = {"http_thread_cpu_s": round(best[2], 3), "wall_s": round(best[1], 2),
                                "requests_per_step": (manager.requests - sent) // args.repeats}
            finally:
                manager.close()
    result["cpu_ratio_per_sample_vs_per_group"] = round(
        result["per_sample"]["http_thread_cpu_s"] / max(result["per_group"]["http_thread_cpu_s"], 1e-3), 1)
    result["same_tokens"] = tokens["per_sample"] == tokens["per_group"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
