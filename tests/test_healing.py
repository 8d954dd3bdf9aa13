"""Self-healing rollout (megarl/rollout/healing.py) on one machine: the manager's restart logic
against fake servers, whole runs where the embedded server hangs (SIGSTOP) or dies with restarts
used up, and the servers' process trees when the driver that started them is SIGKILLed."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.rollout.healing import RolloutServerLost, ServerHealer
from tests.helpers.faults import process_tree
from tests.helpers.runs import ROOT, tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("models"))


# ------------------------------------------------------------------ the manager's side (fake servers)

class FakeServer:
    """An SGLang-shaped server on a thread of its own; ``hung`` makes /generate and /health stall
    (a SIGSTOPped process looks like this from outside)."""

    def __init__(self, hung: bool = False):
        self.hung = hung
        self.generate_calls = 0
        self.loop = asyncio.new_event_loop()

    async def handler(self, request):
        from aiohttp import web

        deadline = time.time() + 600
        while self.hung and time.time() < deadline:   # until stop() (600 s: a hang guard only)
            await asyncio.sleep(0.05)
        if request.path == "/health":
            return web.Response(text="ok")
        self.generate_calls += 1
        body = await request.json()

        def answer(prompt):
            ids = [int(prompt[-1]) + i for i in range(1, 4)]
            return {"output_ids": ids, "meta_info": {
                "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in ids]}}
        prompts = body["input_ids"]
        if prompts and isinstance(prompts[0], list):   # SGLang's batch form: prompt-major, n per item
            params = body.get("sampling_params") or {}
            params = params if isinstance(params, list) else [params] * len(prompts)
            return web.json_response([answer(p) for p, sp in zip(prompts, params) for _ in range(sp.get("n", 1))])
        return web.json_response(answer(prompts))

    def start(self) -> "FakeServer":
        from tests.helpers.http import serve

        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner, port = asyncio.run_coroutine_threadsafe(serve(self.handler), self.loop).result(10)
        self.url = f"http://127.0.0.1:{port}"
        return self

    def stop(self) -> None:
        self.hung = False
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)


class FakeServers:
    """What ServerHealer needs of RolloutServers: ``urls`` and ``restart(i)`` (a fresh server)."""

    def __init__(self, servers: list[FakeServer], fail_restarts: int = 0):
        self.servers = servers
        self.urls = [s.url for s in servers]
        self.fail_restarts = fail_restarts
        self.restart_calls = 0

    def restart(self, i: int) -> str:
        self.restart_calls += 1
        if self.restart_calls <= self.fail_restarts:
            raise RuntimeError("rollout server 0 exited with code 1")
        self.servers[i].stop()
        self.servers[i] = FakeServer().start()
        self.urls[i] = self.servers[i].url
        return self.urls[i]


def _manager(servers: FakeServers, max_restarts: int, pushed: list):
    from megarl.rollout.manager import RolloutManager

    healer = ServerHealer(servers, pushed.append, max_restarts)
    # 3 s: far above what a local answer takes on a loaded box; a hung server never answers
    return RolloutManager(list(servers.urls), timeout_s=3.0, request_retries=1, health_timeout_s=3.0, healer=healer)


def test_hung_server_is_restarted_and_its_requests_wait_for_it():
    """The only server hangs: every request times out, the health probe too; the server is
    restarted once (the weights pushed to it), the waiting requests complete on it, and the
    manager counts the restart and the retries."""
    servers = FakeServers([FakeServer(hung=True).start()])
    pushed: list = []
    mgr = _manager(servers, max_restarts=2, pushed=pushed)
    try:
        old = servers.urls[0]
        out = mgr.generate([[10], [20]], n=2, sampling={"max_new_tokens": 3})
        assert [[o.output_ids for o in g] for g in out] == [[[11, 12, 13]] * 2, [[21, 22, 23]] * 2]
        # both groups travel in one batched request: it timed out once and was sent again
        assert mgr.restarted == 1 and pushed == [0] and mgr.retried == 1 and mgr.dead == set()
        assert mgr.urls[0] == servers.urls[0] != old and servers.servers[0].generate_calls == 1
    finally:
        mgr.close()
        servers.servers[0].stop()


def test_restarts_used_up_end_the_step_with_the_servers_name():
    """max_restarts = 1 and the first restart fails: the step ends with RolloutServerLost naming
    the server, the count and the restart's error (the healthy server's requests finished)."""
    servers = FakeServers([FakeServer(hung=True).start(), FakeServer().start()], fail_restarts=1)
    pushed: list = []
    mgr = _manager(servers, max_restarts=1, pushed=pushed)
    dead = servers.urls[0]
    try:
        with pytest.raises(RolloutServerLost, match=rf"rollout server 0 \({dead}\) is gone and was restarted 1 "
                                                    rf"time\(s\) already \(rollout.max_restarts = 1\): restart 1: "
                                                    rf"RuntimeError: rollout server 0 exited with code 1"):
            mgr.generate([[10], [20]], n=2, sampling={"max_new_tokens": 3})
        assert pushed == [] and mgr.restarted == 0 and mgr._revivals == {}
    finally:
        mgr.close()
        for s in servers.servers:
            s.stop()


# ------------------------------------------------------------------ whole runs (embedded server)

def _run_with_fault(model, out: Path, fault: str, *overrides: str) -> tuple[dict, dict]:
    """A local run whose server gets ``fault`` (SIGSTOP or SIGKILL) at step 1 while it has requests
    in flight; returns (results or the error, facts seen from inside the run)."""
    from megarl.rollout.client import LoopThread, SGLangClient, sampling_params
    from megarl.trainer import Trainer

    cfg = tiny_run_config(model, out, "trainer.total_steps=2", "trainer.eval_before_after=false", "checkpoint.export_hf=false",
                          "rollout.n_per_prompt=2", "batch.global_batch_size=8", "rollout.sampling.max_new_tokens=8",
                          *overrides)
    facts: dict = {"prompts_per_step": cfg.batch.prompts_per_step}

    class Faulty(Trainer):
        def fault_when_busy(self, pid: int) -> None:
            deadline = time.time() + 120
            while time.time() < deadline:
                if self.rollout.manager.outstanding[0] > 0:
                    os.kill(pid, getattr(signal, fault))
                    facts["fault"] = {"pid": pid, "in_flight": self.rollout.manager.outstanding[0]}
                    return
                time.sleep(0.001)

        def setup_rollout(self, servers) -> None:
            super().setup_rollout(servers)
            collect = self.rollout.collect
            self.rollout.collect = lambda loader, step: self.collect_with_fault(collect, loader, step)

        def collect_with_fault(self, collect, loader, step: int):
            if step != 1:
                return collect(loader, step)
            facts["loader_at_step_1"] = json.loads(json.dumps(self.loader.state_dict()))
            t = threading.Thread(target=self.fault_when_busy, args=(self.servers.pid(0),), daemon=True)
            t.start()
            try:
                return collect(loader, step)
            finally:
                t.join(5)
                io = LoopThread()
                try:
                    async def probe():
                        async with SGLangClient(self.servers.urls[0], api_key=self.servers.api_key, retries=0,
                                                timeout_s=20) as c:
                            return (await c.generate([1, 2, 3], sampling_params(max_new_tokens=2, temperature=0.0)))[0]
                    facts["after"] = {"pid": self.servers.pid(0), "version": io.run(probe()).weight_version}
                except Exception as e:  # noqa: BLE001 - the server may be gone for good (restarts used up)
                    facts["after"] = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    io.close()

    try:
        return Faulty(cfg).run(), facts
    except RolloutServerLost as e:
        return {"error": str(e)}, facts


def test_hung_server_is_restarted_with_the_current_weights_and_the_run_finishes(model, tmp_path):
    """SIGSTOP the embedded server while step 1's requests are in flight: they time out
    (rollout.request_timeout_s = 15, several times a normal request's latency on a loaded 2-core box), /health does not answer, the server is stopped for good
    (SIGTERM + SIGCONT, then SIGKILL) and started again with step 1's weights; step 1 finishes
    on it, and so does the run (2 steps)."""
    t0 = time.time()
    results, facts = _run_with_fault(model, tmp_path / "run", "SIGSTOP", "rollout.request_timeout_s=15")
    print(f"\n[healing] hung server run: {time.time() - t0:.1f}s, facts {facts}")
    assert "error" not in results, results
    steps = results["steps"]
    assert len(steps) == 2 and facts["fault"]["in_flight"] > 0
    # in_flight counts samples; they travel in batched requests, each sent again at least once
    assert steps[1]["rollout/restarted_servers"] == 1 and steps[1]["rollout/retried_requests"] >= 1
    assert steps[0]["rollout/restarted_servers"] == 0
    assert facts["after"]["pid"] != facts["fault"]["pid"] and facts["after"]["version"] == "step1", facts
    assert all(s["rollout/logprob_diff_mean"] < 1e-3 for s in steps), [s["rollout/logprob_diff_mean"] for s in steps]


def test_restarts_used_up_write_a_checkpoint_then_fail(model, tmp_path):
    """rollout.max_restarts = 0 and the server is SIGKILLed in step 1: the run ends with an error
    naming the server and the setting, after a checkpoint of step 1's start (the prompt loader
    rewound, so a resume redoes step 1); the killed server's process is gone."""
    results, facts = _run_with_fault(model, tmp_path / "run", "SIGKILL", "rollout.max_restarts=0")
    message = results.get("error", "")
    assert "step 1: rollout server 0 (http://127.0.0.1:" in message, results
    assert "is gone and was restarted 0 time(s) already (rollout.max_restarts = 0)" in message
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    assert f"checkpoint of step 1 written to {ckpt}" in message
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["loader"] == facts["loader_at_step_1"]
    assert (ckpt / "actor").is_dir()
    # the prompt ledger holds step 0 only: step 1's prompts go back to the loader and are drawn again
    from megarl.rollout.ledger import LEDGER_FILE, read_ledger

    account = read_ledger(tmp_path / "run" / LEDGER_FILE)
    assert sorted(account.steps) == [0] and len(account.steps[0]["trained"]) == facts["prompts_per_step"], account


# ------------------------------------------------------------------ the driver dies

DRIVER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from megarl.rollout.launch import RolloutServers
from tests.helpers.runs import tiny_run_config
cfg = tiny_run_config(Path({model!r}), Path({out!r}), *{overrides!r})
servers = RolloutServers(cfg, Path({model!r}), Path({out!r}) / "logs")
servers.wait_healthy(400)
print(json.dumps({{"pid": servers.pid(0), "url": servers.urls[0]}}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("engine", ["sglang"])
def test_driver_killed_leaves_no_server_process_behind(model, tmp_path, engine):
    """A driver starts a TP2 server (SGLang's own launcher on CPU, with its scheduler processes and
    detokenizer as children), then is SIGKILLed (nothing of it runs any more): the server's leader
    gets SIGTERM (parent-death signal of the thread that started it) and its whole process tree is
    gone (waited for up to 5 minutes: a hang guard, a loaded box tears SGLang down slowly). (The embedded server's TP followers die with their leader:
    tests/test_server_tp.py.)"""
    from megarl.trainer import Trainer  # noqa: F401 - import cost outside the timed part
    from tests.helpers.runs import tiny_run_config as _  # noqa: F401

    overrides = ["rollout.tp=2"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if engine == "sglang":
        from tests.sglang_cpu.server import server_command

        overrides += ["rollout.engine=sglang", "rollout.server_command=[" + ",".join(server_command()) + "]"]
    code = DRIVER.format(root=str(ROOT), model=str(model), out=str(tmp_path / "run"), overrides=overrides)
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    tree: set[int] = set()
    t0 = time.time()
    try:
        line = driver.stdout.readline()
        assert line, f"driver exited with {driver.wait(30)} before its server was healthy"
        started = json.loads(line)
        deadline = time.time() + 300   # a hang guard: the loop ends once the children are seen
        while time.time() < deadline:   # SGLang's children: scheduler (per TP rank) and detokenizer
            tree = process_tree(started["pid"])
            if len(tree) >= 3:
                break
            time.sleep(0.2)
        assert len(tree) >= (3 if engine == "sglang" else 2), tree
        if engine == "sglang":   # told to exit at once on SIGTERM, not to finish its requests first
            environ = Path(f"/proc/{started['pid']}/environ").read_bytes().split(b"\0")
            assert b"SGL_FORCE_SHUTDOWN=1" in environ
            # ... the variable SGLang's own SIGTERM watchdog reads to skip draining its requests
            import importlib.util

            spec = importlib.util.find_spec("sglang")
            manager = Path(spec.origin).parent / "srt" / "managers" / "tokenizer_manager.py"
            watchdog = manager.read_text().split("async def sigterm_watchdog", 1)[1].split("\n    def ", 1)[0]
            assert 'get_bool_env_var("SGL_FORCE_SHUTDOWN")' in watchdog and "force_exit_handler" in watchdog
        t1 = time.time()
        driver.send_signal(signal.SIGKILL)
        driver.wait(300)
        deadline = time.time() + 300
        alive = tree
        while alive and time.time() < deadline:
            alive = {p for p in tree if _alive(p)}
            time.sleep(0.2)
        assert not alive, f"left behind after the driver died: {_cmdlines(alive)}"
        print(f"\n[healing] {engine}: {len(tree)} server processes up in {t1 - t0:.1f}s, all gone "
              f"{time.time() - t1:.1f}s after the driver's SIGKILL")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
        for pid in tree:   # never leave processes behind, even when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        driver.stdout.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdlines(pids: set[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            pass
    return out
