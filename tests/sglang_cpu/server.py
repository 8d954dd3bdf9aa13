"""An SGLang server process for tests: SGLang's own launcher on CPU (launch_server.py), started
with the flags megarl's launcher builds for a run (`megarl.rollout.launch.sglang_args`) through
megarl's own process owner (`ServerHost`), so a test that talks to it also proves SGLang accepts
megarl's command line."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ["-m", "tests.sglang_cpu.launch_server"]


def sglang_cpu_python() -> str:
    """The SGLang CPU environment's interpreter (launch/install_sglang_cpu.sh makes it)."""
    py = os.environ.get("MEGARL_SGLANG_CPU_PYTHON") or str(ROOT / ".venv-sglang-cpu" / "bin" / "python")
    if not os.access(py, os.X_OK):
        raise RuntimeError(f"no SGLang CPU environment at {py}: run `bash launch/install_sglang_cpu.sh` "
                           "(launch/install.sh does it)")
    return py


def server_command() -> list[str]:
    """`rollout.server_command` that runs SGLang's code on CPU."""
    return [sglang_cpu_python(), *LAUNCHER]


def harness_env(record_dir: Optional[str] = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if record_dir:
        env["SGLANG_CPU_RECORD_DIR"] = record_dir
    return env


class SGLangCPUServer:
    """`with SGLangCPUServer(model_dir, cfg, tp=2, api_key=k, log_dir=d) as s: s.url`"""

    def __init__(self, model_dir: Path, cfg, log_dir: Path, index: int = 0, api_key: Optional[str] = None,
                 record_dir: Optional[str] = None):
        from megarl.rollout.launch import ServerHost

        log_dir.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        self._launch = (model_dir, cfg, log_dir, index, record_dir)
        self.host = ServerHost()
        self.log = log_dir / f"sglang_{index}.log"
        self._start()

    def _start(self) -> None:
        """At a fresh free port, with megarl's flags for it."""
        from megarl.rollout.launch import LaunchSpec, sglang_args, sglang_key_file_text
        from megarl.wire.addresses import free_port

        model_dir, cfg, log_dir, index, record_dir = self._launch
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key_file = str(log_dir / f"sglang_{index}.yaml") if self.api_key else None
        self.args = sglang_args(cfg, model_dir, LaunchSpec(index, "127.0.0.1", self.port, key_file))
        private = {key_file: sglang_key_file_text(self.api_key)} if self.api_key else {}
        self.host.start(server_command() + self.args, harness_env(record_dir), str(self.log), private)

    def wait_ready(self, timeout_s: float = 400.0) -> "SGLangCPUServer":
        """Until it answers /health; started again at another port (at most 3 times) when its free
        port was taken before it bound it, as `RolloutServers` does."""
        from megarl.rollout.launch import PortTaken

        for attempt in range(4):
            try:
                self.host.wait_healthy(self.url, timeout_s, poll_s=0.5)
                return self
            except PortTaken:
                if attempt == 3:
                    self.stop()
                    raise
                self._start()   # (start stops the hung one first)
            except TimeoutError:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        self.host.stop()

    def __enter__(self) -> "SGLangCPUServer":
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - manual use
    print(" ".join(server_command() + sys.argv[1:]))
