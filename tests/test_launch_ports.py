"""A rollout server whose free port another process took before the server bound it: uvicorn (the
HTTP server of SGLang and of megarl's engine) logs its bind error, and SGLang then hangs instead of
exiting. The launcher must see that in the log and start the server again on another port, not wait
for /health until its timeout (CI met it: two SGLang servers started together, one found its port
taken and the fixture waited 400 s)."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from megarl.rollout.launch import PortTaken, RolloutServers, ServerHost, answers_health
from megarl.wire import addresses
from tests.helpers.runs import tiny_model, tiny_run_config

# -P: not its own folder first on sys.path (tests/helpers/http.py would shadow the standard library's)
STAND_IN = str(Path(__file__).resolve().parent / "helpers" / "port_server.py")


def _held_port() -> tuple[socket.socket, int]:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


def test_the_launcher_starts_a_server_whose_port_was_taken_again_on_another(tmp_path, monkeypatch):
    holder, taken = _held_port()
    handed = []
    real = addresses.free_port

    def free_port(host: str = "127.0.0.1") -> int:   # the first port handed out is already taken
        handed.append(taken if not handed else real(host))
        return handed[-1]

    monkeypatch.setattr(addresses, "free_port", free_port)
    cfg = tiny_run_config(tiny_model(tmp_path), tmp_path / "out", f"rollout.server_command=[{sys.executable},-P,{STAND_IN}]")
    servers = RolloutServers(cfg, Path(cfg.model.hf_path), tmp_path / "logs")
    try:
        servers.wait_healthy(120)
        assert handed[0] == taken and len(handed) == 2, handed     # started twice, the second time elsewhere
        assert servers.urls[0].endswith(f":{handed[1]}") and answers_health(servers.urls[0])
    finally:
        servers.stop()
        holder.close()


def test_a_hosts_wait_says_at_once_that_its_port_was_taken(tmp_path):
    """`ServerHost.wait_healthy` (the test harness's SGLang servers use it) raises `PortTaken` from
    uvicorn's own bind error while the process still runs, well before its timeout."""
    holder, taken = _held_port()
    host = ServerHost()
    try:
        host.start([sys.executable, "-P", STAND_IN, "--port", str(taken)], {"PATH": "/usr/bin:/bin"}, str(tmp_path / "s.log"))
        try:
            host.wait_healthy(f"http://127.0.0.1:{taken}/", timeout_s=120)
        except PortTaken as e:
            assert "address already in use" in str(e) and host.poll() is None   # alive, as SGLang is
        else:
            raise AssertionError("the held port answered /health")
    finally:
        host.stop()
        holder.close()
