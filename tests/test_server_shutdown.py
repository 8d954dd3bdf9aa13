"""The embedded server told to exit (SIGTERM: `ServerHost.stop`, or the trainer's death through
PR_SET_PDEATHSIG) answers what it holds and exits: a running request comes back aborted with the
tokens it has, a request waiting behind a pause comes back aborted too, and the process exits 0,
at TP1 and at TP2 (whose other rank, a child process, leaves with it).
Before, the engine thread stopped with their futures unresolved, the HTTP handlers waited on them,
and the web runner sat out its shutdown timeout with no answer sent.

What holds the requests is the test's own pause (and a generation longer than any test), never a
machine too slow to finish them."""
import asyncio
import json
import signal
import time

import psutil
import pytest

from megarl.rollout.client import ServerError, SGLangClient, sampling_params
from tests.helpers.inflight import HANG_S, until_generating
from tests.helpers.models import make_tiny_chat_model
from tests.helpers.servers import ServerProcess

KEY = "shutdown-test-key"
CONTEXT = 1 << 14


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_answers_running_and_queued_requests_then_exits(tmp_path, tp):
    """At TP2 the request is held inside a step that both ranks run; rank 1 must leave with rank 0."""
    model = make_tiny_chat_model(tmp_path / "tinychat")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, max_position_embeddings=CONTEXT)))
    extra = ["--skip-tokenizer-init", "--context-length", str(CONTEXT), "--max-running-requests", "4"]
    server = ServerProcess(str(model), extra=extra + (["--tp-size", str(tp)] if tp > 1 else []),
                           env={"MEGARL_API_KEY": KEY})
    long = sampling_params(max_new_tokens=CONTEXT - 64, temperature=0.0, ignore_eos=True)
    ranks: list[int] = []   # the server's child processes (TP ranks) when the signal went
    try:
        server.wait_ready()

        async def scenario():
            async with SGLangClient(server.url, api_key=KEY) as c:
                running = asyncio.ensure_future(c.generate([1, 2, 3, 4], long, rid="running"))
                await until_generating(server.url, "running", api_key=KEY, tasks=[running])
                assert not running.done()
                await c.pause_generation("in_place")       # holds "running" where it is
                queued = asyncio.ensure_future(c.generate([5, 6, 7], long, rid="queued"))
                await asyncio.sleep(0.2)   # let it reach the server's pause (if not, it meets a closed server)
                assert not queued.done()
                ranks.extend(child.pid for child in psutil.Process(server.proc.pid).children(recursive=True))
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), HANG_S)

        running, queued = asyncio.run(scenario())
        assert not isinstance(running, BaseException), running
        # waiting out the pause, it never reached the engine: refused (503), or the server already gone
        assert not isinstance(queued, BaseException) or isinstance(queued, ServerError), queued
        out = running[0]
        assert out.finish_reason == "abort" and 0 < len(out.output_ids) < CONTEXT - 64
        if not isinstance(queued, BaseException):
            assert queued[0].finish_reason == "abort" and queued[0].output_ids == []
        assert server.proc.wait(HANG_S) == 0
        if tp > 1:
            assert ranks, "a TP2 server runs its other rank as a child process"
        deadline = time.monotonic() + HANG_S
        while _alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(ranks), f"rank processes left behind: {_alive(ranks)}"
    finally:
        server.stop()
