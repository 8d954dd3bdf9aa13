"""`python -m tests.sglang_cpu.launch_server <sglang.launch_server flags>`: SGLang 0.5.23's own
launcher on CPU -- its argument parser (`prepare_server_args`), `launch_server` (port allocation,
tokenizer manager, detokenizer, API-key middleware, uvicorn, warm-up request, /health) -- with the
scheduler process replaced through `launch_server`'s `run_scheduler_process_func` argument
(tests/sglang_cpu/scheduler.py). Used as `rollout.server_command` by the conformance tests, so the
exact command line megarl builds for SGLang is parsed and served by SGLang's code.
"""
from __future__ import annotations

import os
import sys


def cpu_binding(ranks: int) -> str:
    """SGLang's CPU TP wants each rank's cores (`SGLANG_CPU_OMP_THREADS_BIND`, "a-b|c-d"); on a
    box with fewer NUMA nodes than ranks it refuses to guess. Split this process's cores evenly
    (ranks share cores when there are fewer cores than ranks)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(len(cores) // ranks, 1)
    spans = []
    for r in range(ranks):
        chunk = [cores[(r * per + i) % len(cores)] for i in range(per)]
        spans.append(f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else str(chunk[0]))
    return "|".join(spans)


def fork_children() -> None:
    """SGLang forces the "spawn" start method (CUDA cannot be forked); on CPU every spawned child
    would import SGLang again (~30 s of CPU each on the 2-core CI box, 3-4 children per server).
    Children forked from this process start at once with SGLang already imported. This changes how
    processes start, not what they run."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def keep_fork(method=None, force=False):
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = keep_fork


def main(argv: list[str]) -> None:
    import tests.sglang_cpu.stubs as stubs

    stubs.install()
    fork_children()
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from tests.sglang_cpu.scheduler import run_cpu_scheduler_process

    server_args = prepare_server_args(argv)
    if server_args.device != "cpu":
        raise SystemExit("tests.sglang_cpu: pass --device cpu (this harness runs SGLang's code on CPU)")
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_binding(server_args.tp_size))
    try:
        launch_server(server_args, run_scheduler_process_func=run_cpu_scheduler_process)
    finally:
        kill_process_tree(None, include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
